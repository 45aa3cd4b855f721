"""strategy=fsdp on real gloo ranks: the same training as DDP, with parameters, gradients and optimizer state sharded.

Same data, same global batch, 10 steps: FSDP's parameters equal DDP's within fp32
tolerance, with gradient accumulation (set_requires_gradient_sync) and with the
global gradient norm clipped (the norm over all shards equals DDP's norm).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from multigpu.testing import run_on_ranks
from multigpu.train import ModelConfig, TrainConfig, Trainer, make_optimizer, make_scheduler
from multigpu.train.data import VOCAB, CharDataset
from multigpu.train.model import GPT

pytestmark = pytest.mark.dist

TINY = ModelConfig(n_layer=2, n_head=2, n_embd=16, block_size=16)
BASE = TrainConfig(steps=10, global_batch_size=12, lr=3e-3, warmup_steps=2, eval_every=0, log_every=0,
                   checkpoint_every=0, prefetch=0, grad_clip=0.0)


def _tokens() -> torch.Tensor:
    """256 samples: 10 steps of 12 stay in the first epoch, which then holds the same samples on 1, 2 and 3 ranks."""
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, len(VOCAB), (16 * 256 + 1,), generator=gen, dtype=torch.uint8)


def full(state: dict) -> dict[str, torch.Tensor]:
    """A state dict with DTensor shards gathered into whole tensors (a collective under fsdp)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _run(cfg: TrainConfig) -> dict[str, object]:
    torch.manual_seed(0)
    model = GPT(TINY, len(VOCAB))
    optimizer = make_optimizer(model, cfg)
    data = CharDataset(_tokens(), TINY.block_size)
    trainer = Trainer(model, optimizer, data, config=cfg, val_data=data, scheduler=make_scheduler(optimizer, cfg))
    trainer.setup()
    norms = []
    while trainer.step < cfg.steps:
        norms.append(trainer.train_step()["grad_norm"].item())
        trainer.step += 1
    val = trainer.evaluate()
    trainer.close()
    return {"params": full(model.state_dict()), "norms": norms, "val": val,
            "sharded": any(hasattr(p, "full_tensor") for p in model.parameters())}


def _both(cfg: TrainConfig) -> dict[str, dict]:
    return {"ddp": _run(cfg), "fsdp": _run(dataclasses.replace(cfg, strategy="fsdp"))}


def _variants() -> dict[str, dict]:
    accum = dataclasses.replace(BASE, grad_accum=2, grad_accum_scope="per_rank", grad_clip=0.05)
    return {"plain": _both(BASE), "accum_clip": _both(accum)}


def _assert_same_training(result: dict, what: str) -> None:
    ddp, fsdp = result["ddp"], result["fsdp"]
    assert fsdp["sharded"] and not ddp["sharded"]
    for key, value in ddp["params"].items():
        diff = (value - fsdp["params"][key]).abs().max().item()
        assert torch.allclose(value, fsdp["params"][key], rtol=1e-5, atol=1e-6), f"{what}: {key} differs by {diff:.3g}"
    assert fsdp["norms"] == pytest.approx(ddp["norms"], rel=1e-5), what
    assert fsdp["val"] == pytest.approx(ddp["val"], rel=1e-5), what


def test_fsdp_trains_like_ddp_on_2_ranks_with_accumulation_and_clipping(jobs):
    ranks = [r["variants"] for r in jobs[1]]
    for name, result in ranks[0].items():
        _assert_same_training(result, f"2 ranks, {name}")
    clipped = ranks[0]["accum_clip"]["ddp"]["norms"]
    assert min(clipped) > 0.05  # the limit was in force on every step, so clipping was compared too


def _three(_=None) -> dict:
    return _both(dataclasses.replace(BASE, grad_accum=2, grad_clip=0.05))


def test_fsdp_trains_like_ddp_on_3_ranks(jobs):
    ranks = [r["three"] for r in jobs[2]]
    _assert_same_training(ranks[0], "3 ranks, accum_clip")


CKPT = dataclasses.replace(BASE, strategy="fsdp", lr_decay_steps=10, checkpoint_every=5, keep_last=5)


def _train(cfg: TrainConfig, run_dir: str, resume: str | None = None) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(TINY, len(VOCAB))
    optimizer = make_optimizer(model, cfg)
    trainer = Trainer(model, optimizer, CharDataset(_tokens(), TINY.block_size), config=cfg,
                      scheduler=make_scheduler(optimizer, cfg), run_dir=run_dir, resume=resume)
    trainer.fit()
    trainer.close()
    return full(model.state_dict())


def _save_resume_export(tmp: str) -> dict[str, object]:
    """On 2 ranks: 10 steps straight; 5 steps then resumed to 10; the consolidated export of the first."""
    import multigpu as mg
    from multigpu.train.job import export_state, full_state

    whole = _train(CKPT, f"{tmp}/whole")
    model = _trained_model()
    state = full_state(model)
    if mg.is_main():
        export_state(state, Path(tmp) / "model.safetensors")
    _train(dataclasses.replace(CKPT, steps=5), f"{tmp}/parts")
    resumed = _train(CKPT, f"{tmp}/resumed", resume=f"{tmp}/parts/checkpoints/step_00000005")
    return {"whole": whole, "same": all(torch.equal(whole[k], resumed[k]) for k in whole),
            "exported": full(model.state_dict())}


def _trained_model():
    """A model after 2 fsdp steps (no files), for the export."""
    cfg = dataclasses.replace(CKPT, steps=2, checkpoint_every=0)
    torch.manual_seed(0)
    model = GPT(TINY, len(VOCAB))
    optimizer = make_optimizer(model, cfg)
    trainer = Trainer(model, optimizer, CharDataset(_tokens(), TINY.block_size), config=cfg,
                      scheduler=make_scheduler(optimizer, cfg))
    trainer.fit()
    trainer.close()
    return model


def _on_two_ranks(tmp: str) -> dict[str, object]:
    """The 2-rank job of this module: ddp vs fsdp (plain, accumulation and clipping), then the checkpoint's save,
    resume and export (one job: its start-up costs more than either)."""
    return {"variants": _variants(), "ckpt": _save_resume_export(tmp)}


def _on_three_ranks(tmp: str, step5: str) -> dict[str, object]:
    """The 3-rank job: ddp vs fsdp with accumulation and clipping, then the 2-rank checkpoint resumed on 3 ranks."""
    return {"three": _three(), "resumed": _train(CKPT, f"{tmp}/on3", step5)}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """(folder, the 2-rank job's results, the 3-rank job's results), in rank order: every test here reads them."""
    tmp = tmp_path_factory.mktemp("fsdp")
    two = run_on_ranks(_on_two_ranks, 2, args=(str(tmp),), timeout_s=240)
    step5 = tmp / "parts" / "checkpoints" / "step_00000005"
    three = run_on_ranks(_on_three_ranks, 3, args=(str(tmp), str(step5)), timeout_s=240)
    return tmp, two, three


def test_sharded_checkpoint_resumes_on_2_1_and_3_ranks_and_exports_one_file(jobs):
    import multigpu as mg

    tmp_path = jobs[0]
    two = [r["ckpt"] for r in jobs[1]]
    assert two[0]["same"] and two[1]["same"], "2 -> 2 ranks: not bit-identical"
    step5 = tmp_path / "parts" / "checkpoints" / "step_00000005"
    assert sorted(p.name for p in step5.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp",
                                                       "manifest.json", "state.pt"]
    whole = two[0]["whole"]
    three = [r["resumed"] for r in jobs[2]]
    mg.init(backend="cpu", threads=1)
    try:
        one = _train(CKPT, str(tmp_path / "on1"), str(step5))
    finally:
        mg.shutdown()
    for name, got in (("2 -> 1", one), ("2 -> 3", three[0])):
        for key in whole:
            diff = (whole[key] - got[key]).abs().max().item()
            assert torch.allclose(whole[key], got[key], rtol=1e-5, atol=1e-6), f"{name}: {key} differs by {diff:.3g}"

    from safetensors.torch import load_model

    plain = GPT(TINY, len(VOCAB))
    load_model(plain, str(tmp_path / "model.safetensors"))
    for key, value in plain.state_dict().items():
        assert torch.equal(value, two[0]["exported"][key]), f"export: {key} differs"
    assert plain.head.weight is plain.tok.weight  # still tied
