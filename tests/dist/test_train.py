"""The trainer on real gloo ranks: results independent of the split, sync backends, exact resume.

These pin the data-parallel contract: a global batch split over 2 ranks (or
accumulated on 1) takes the same optimizer steps as one rank with the whole
batch; the ``cpu`` hook averages exactly as gloo does; and a run stopped at
step k and resumed from its checkpoint ends bit for bit where the uninterrupted
run ends (with dropout on, so every rank's random state must be restored).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

import multigpu as mg
from multigpu.testing import run_on_ranks
from multigpu.train import ModelConfig, TrainConfig, Trainer, make_optimizer, make_scheduler
from multigpu.train.data import VOCAB, CharDataset
from multigpu.train.model import GPT
from tests.conftest import not_tested_here

pytestmark = pytest.mark.dist

TINY = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
BASE = TrainConfig(steps=4, global_batch_size=8, lr=3e-3, warmup_steps=1, eval_every=0, log_every=0,
                   checkpoint_every=0, prefetch=0)


def _tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, len(VOCAB), (16 * 64 + 1,), generator=gen, dtype=torch.uint8)


def _train(cfg: TrainConfig, run_dir=None, resume=None, shape: ModelConfig = TINY) -> dict[str, torch.Tensor]:
    """Train the tiny GPT with ``cfg`` on every rank of the current job; return rank-local parameters."""
    torch.manual_seed(0)  # identical initial weights on every rank
    model = GPT(shape, len(VOCAB))
    optimizer = make_optimizer(model, cfg)
    data = CharDataset(_tokens(), shape.block_size)
    trainer = Trainer(model, optimizer, data, config=cfg, val_data=data, scheduler=make_scheduler(optimizer, cfg),
                      run_dir=run_dir, resume=resume)
    torch.manual_seed(100 + mg.rank())  # dropout masks differ per rank, so each rank's RNG must be restored
    trainer.fit()
    trainer.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mlp(compile: bool) -> dict:
    """A small regression MLP trained 3 steps, eagerly or with ``compile=True`` (torch.compile over DDP, inductor's
    C++ kernels on the CPU): its parameters, and whether the trainer really compiled it."""
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 16, generator=gen)
    data = TensorDataset(x, x @ torch.linspace(-1, 1, 16))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    cfg = dataclasses.replace(BASE, steps=3, global_batch_size=32, compile=compile)

    def mse(net, batch):
        return torch.nn.functional.mse_loss(net(batch[0]).squeeze(-1), batch[1])

    before = model[0].weight.detach().clone()
    trainer = Trainer(model, make_optimizer(model, cfg), data, config=cfg, loss_fn=mse, unit="samples")
    trainer.fit()
    trainer.close()
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "compiled": type(trainer.model).__name__ == "OptimizedModule", "moved": not torch.equal(before, model[0].weight)}


def _variants() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "split": _train(BASE),                                     # 2 ranks × 4 = global batch 8, gloo
        "split_prefetch": _train(dataclasses.replace(BASE, prefetch=2)),
        "cpu_hook": _train(dataclasses.replace(BASE, sync_backend="cpu")),
        "accum": _train(dataclasses.replace(BASE, global_batch_size=None, batch_size=4, grad_accum=2,
                                            grad_accum_scope="global")),  # 1 micro-step per rank on 2 ranks
        "eager": _mlp(compile=False),
        "compiled": _mlp(compile=True),
    }


def _one_rank_references() -> dict[str, dict[str, torch.Tensor]]:
    mg.init(backend="cpu", threads=1)  # world_size 1 in this process: the same code, no DDP
    try:
        return {
            "split": _train(BASE),                                 # 1 rank × batch 8
            "accum": _train(dataclasses.replace(BASE, global_batch_size=None, batch_size=4, grad_accum=2,
                                                grad_accum_scope="global")),  # 2 micro-steps of 4
        }
    finally:
        mg.shutdown()


def _assert_close(a: dict, b: dict, what: str) -> None:
    for key in a:
        diff = (a[key] - b[key]).abs().max().item()
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-6), f"{what}: {key} differs by {diff:.3g}"


def test_split_accumulation_and_sync_backends_match_one_rank(request, job):
    """Also: training with compile=true (torch.compile of the DDP model, inductor's C++ kernels) takes the eager
    run's steps. One compile thread per rank: no pool of compile workers beside the ranks. Without a C++ compiler
    the trainer runs eagerly, as documented, and the run's summary says compile was not tested."""
    can_compile = any(shutil.which(c) for c in ("c++", "g++", "clang++", "cc"))
    if not can_compile:
        not_tested_here(request, "training with torch.compile: no C++ compiler (c++, g++, clang++, cc)")
    ranks = [dict(r["variants"]) for r in job[1]]  # a copy: the loop below pops from it
    ref = _one_rank_references()
    for rank in ranks:
        eager, compiled = rank.pop("eager"), rank.pop("compiled")
        assert compiled["compiled"] is bool(can_compile) and not eager["compiled"] and compiled["moved"]
        _assert_close(compiled["params"], eager["params"], "compiled vs eager")
    two = ranks[0]
    for name in two:  # DDP keeps replicas identical, bit for bit
        for key in two[name]:
            assert torch.equal(two[name][key], ranks[1][name][key]), f"{name}: ranks disagree on {key}"
    assert not torch.equal(two["split"]["tok.weight"], GPT(TINY, len(VOCAB)).tok.weight)  # it trained
    _assert_close(two["split"], ref["split"], "2 ranks × B/2 vs 1 rank × B")
    _assert_close(two["accum"], ref["accum"], "2 ranks vs 1 rank with accumulation 2")
    for key in two["split"]:
        assert torch.equal(two["split"][key], two["cpu_hook"][key]), f"cpu hook vs gloo: {key} differs"
        assert torch.equal(two["split"][key], two["split_prefetch"][key]), f"prefetch changed {key}"


def _hooks_average(_=None) -> list[bool]:
    """Each sync backend's gradients equal the mean of the ranks' local gradients."""
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: F401

    from multigpu.train.strategies import wrap_ddp

    out = []
    for backend in ("auto", "gloo", "cpu"):
        torch.manual_seed(0)
        net = torch.nn.Linear(8, 3)
        x = torch.randn(5, 8) * (mg.rank() + 1)  # different data on each rank
        local = torch.autograd.grad(net(x).square().sum(), net.weight)[0]
        expected = mg.all_reduce(local.clone(), "mean")
        ddp, timer = wrap_ddp(net, mg.get_env(), backend)
        ddp(x).square().sum().backward()
        out.append(torch.allclose(net.weight.grad, expected, rtol=1e-6) and not torch.allclose(local, expected))
        out.append(timer is not None and timer.pop_seconds() > 0)  # the all-reduce was timed
    return out


def test_every_sync_backend_averages_across_ranks(job):
    for flags in (r["hooks"] for r in job[1]):
        assert all(flags), flags


def _stop_and_resume(tmp: str) -> dict[str, object]:
    cfg = dataclasses.replace(BASE, steps=6, lr_decay_steps=6, eval_every=3, checkpoint_every=3, keep_last=5,
                              prefetch=2, log_every=2)
    shape = dataclasses.replace(TINY, dropout=0.2)
    whole = _train(cfg, run_dir=f"{tmp}/whole", shape=shape)
    _train(dataclasses.replace(cfg, steps=3), run_dir=f"{tmp}/parts", shape=shape)      # stops after step 3
    resumed = _train(cfg, run_dir=f"{tmp}/parts", resume="auto", shape=shape)  # continues to 6
    if mg.rank() == 0:  # the whole run rewound to step 3 (as --resume PATH sets the later checkpoints aside)
        shutil.copytree(f"{tmp}/whole", f"{tmp}/rewound")
        shutil.rmtree(f"{tmp}/rewound/checkpoints/step_00000006")
    mg.barrier()
    _train(cfg, run_dir=f"{tmp}/rewound", resume=f"{tmp}/rewound/checkpoints/step_00000003", shape=shape)
    return {"same": all(torch.equal(whole[k], resumed[k]) for k in whole),
            "trained": not torch.equal(whole["tok.weight"], GPT(TINY, len(VOCAB)).tok.weight)}


def test_stop_and_resume_is_bit_identical(job):
    tmp_path = job[0] / "resume"
    for result in (r["resume"] for r in job[1]):
        assert result == {"same": True, "trained": True}
    names = sorted(p.name for p in (tmp_path / "parts" / "checkpoints").glob("step_*"))
    assert names == ["step_00000003", "step_00000006"]
    step6 = tmp_path / "parts" / "checkpoints" / "step_00000006"
    state = torch.load(step6 / "state.pt", weights_only=True)
    manifest = json.loads((step6 / "manifest.json").read_text())
    assert state["trainer"]["step"] == 6 and len(state["rng"]) == 2 and manifest["world_size"] == 2
    assert state["rng"][0]["torch"].ne(state["rng"][1]["torch"]).any()  # every rank's own RNG state
    # a resumed run's metrics.jsonl: each step once, with the figures of the uninterrupted run's records (log_every
    # 2, validation at 3 and 6: windows 1-2, 3, 4, 5-6), also where the run it continues had logged steps 4 and 6
    # already (rewound from step 6 to step 3: those records go, the resumed run writes them again)
    whole = _records(tmp_path / "whole")
    assert [r["step"] for r in whole] == [2, 3, 4, 6]
    for name in ("parts", "rewound"):
        records = _records(tmp_path / name)
        assert [r["step"] for r in records] == [2, 3, 4, 6], (name, records)
        for a, b in zip(whole, records, strict=True):
            assert {k: a.get(k) for k in _FIGURES} == {k: b.get(k) for k in _FIGURES}, (name, a, b)


_FIGURES = ("loss", "val_loss", "grad_norm", "lr", "world_size")


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ----------------------------------------------------------------------------- a non-finite loss
class _NanOnRank1AtStep5:
    """The default loss, made NaN on rank 1 at its 5th call (step 5 with no accumulation)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model, batch):
        from multigpu.train.trainer import default_loss

        self.calls += 1
        loss = default_loss(model, batch)
        return loss * float("nan") if self.calls == 5 and mg.rank() == 1 else loss


def _train_into_nan(run_dir: str, nonfinite: str, log_every: int):
    from multigpu.errors import NonFiniteError

    cfg = dataclasses.replace(BASE, steps=10, checkpoint_every=2, keep_last=2, log_every=log_every,
                              nonfinite=nonfinite)
    torch.manual_seed(0)
    model = GPT(TINY, len(VOCAB))
    trainer = Trainer(model, make_optimizer(model, cfg), CharDataset(_tokens(), TINY.block_size), config=cfg,
                      run_dir=run_dir, loss_fn=_NanOnRank1AtStep5())
    try:
        trainer.fit()
        error = None
    except NonFiniteError as exc:
        error = str(exc)
    finally:
        trainer.close()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return {"error": error, "step": trainer.step, "skipped": trainer.skipped_steps, "finite": finite}


@pytest.mark.parametrize("log_every", [3, 0], ids=["stopped-at-a-log-point", "stopped-before-a-checkpoint"])
def test_a_nan_loss_on_one_rank_stops_every_rank_naming_the_step_and_keeps_the_good_checkpoints(job, log_every):
    """Before: ``loss nan | grad_norm nan`` to the end, exit 0, and the NaN checkpoints rotated the good ones out."""
    tmp_path = job[0] / f"nan_stop_{log_every}"
    results = [r[f"nan_stop_{log_every}"] for r in job[1]]
    for r in results:
        assert r["error"] is not None and r["step"] == 6, r  # the log point (or checkpoint) after step 5
        assert r["error"].startswith("the loss is nan and the gradient norm nan at step 5 on rank 1 (its first "
                                     "non-finite step); training stopped at step 6, before a checkpoint"), r["error"]
    kept = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert kept == ["step_00000002", "step_00000004"]  # no step-6 checkpoint of NaN weights
    state = torch.load(tmp_path / "checkpoints" / "step_00000004" / "state.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values())


def test_nonfinite_skip_skips_that_optimizer_step_on_every_rank(job):
    results = [r["nan_skip"] for r in job[1]]
    assert [(r["error"], r["step"], r["skipped"], r["finite"]) for r in results] == [(None, 10, 1, True)] * 2


# ----------------------------------------------------------------------------- the module's one 2-rank job
def _every_part(tmp: str) -> dict[str, object]:
    """Every 2-rank check of this module in one job (its start-up costs more than most of them): the sync
    backends, stop and resume, the non-finite losses, then the split/accumulation/compile variants (last: the
    only one that compiles). Each part seeds its own RNG and writes under its own folder of ``tmp``."""
    return {"hooks": _hooks_average(),
            "resume": _stop_and_resume(f"{tmp}/resume"),
            "nan_stop_3": _train_into_nan(f"{tmp}/nan_stop_3", "stop", 3),
            "nan_stop_0": _train_into_nan(f"{tmp}/nan_stop_0", "stop", 0),
            "nan_skip": _train_into_nan(f"{tmp}/nan_skip", "skip", 3),
            "variants": _variants()}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(folder, each rank's results of ``_every_part``): one 2-rank job every test here reads."""
    tmp = tmp_path_factory.mktemp("train2")
    return tmp, run_on_ranks(_every_part, 2, args=(str(tmp),), timeout_s=600,
                             env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})
