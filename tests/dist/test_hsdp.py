"""strategy=hsdp: a 2-D (replicate, shard) mesh trains like DDP, and its checkpoints resume on other layouts.

4 ranks as 2 replicas × 2 shards (``hsdp_shard_size=2``, as two nodes of two ranks
would be by default): each parameter is a DTensor placed (Replicate, Shard(0)), each
rank holds half of it, and after 10 steps the parameters, gradient norms and
validation loss equal DDP's within fp32 tolerance (the same checks as fsdp's).
Its checkpoint of step 5 (DCP shards on the 2-D mesh) resumes on 2 ranks under ddp
(whole tensors), fsdp (a 1-D mesh) and hsdp (1 replica × 2): each run's step 10
equals the uninterrupted 2 × 2 run's within fp32 tolerance.
(tests/cli/test_hsdp_e2e.py runs the same from the command line on two loopback nodes.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from multigpu.testing import run_on_ranks
from tests.dist.test_fsdp import BASE, CKPT, _assert_same_training, _run, _train

pytestmark = pytest.mark.dist

HSDP_CKPT = dataclasses.replace(CKPT, strategy="hsdp", hsdp_shard_size=2)
"""10 steps, a checkpoint every 5."""


def _hsdp_and_ddp(tmp: str) -> dict:
    import multigpu as mg
    from multigpu.errors import ConfigError
    from multigpu.train.strategy_checks import check_hsdp

    hsdp = dataclasses.replace(BASE, strategy="hsdp", hsdp_shard_size=2)
    result = {"ddp": _run(BASE), "fsdp": _run(hsdp), "whole": _train(HSDP_CKPT, f"{tmp}/whole")}
    try:
        check_hsdp(mg.world_size(), 3)
    except ConfigError as exc:
        result["refused"] = str(exc)
    return result


def _resumed_on_2_ranks(tmp: str) -> dict:
    """The 2 x 2 run's checkpoint of step 5, resumed to step 10 under each strategy (hsdp: 1 replica of 2)."""
    step5 = f"{tmp}/whole/checkpoints/step_00000005"
    out = {}
    for strategy in ("ddp", "fsdp", "hsdp"):
        cfg = dataclasses.replace(CKPT, strategy=strategy, checkpoint_every=0)
        out[strategy] = _train(cfg, f"{tmp}/{strategy}", step5)
    return out


def _placements(_=None) -> list:
    import torch

    from multigpu.train import ModelConfig, TrainConfig, Trainer, make_optimizer
    from multigpu.train.data import VOCAB, CharDataset
    from multigpu.train.model import GPT

    cfg = TrainConfig(steps=1, batch_size=1, eval_every=0, log_every=0, prefetch=0, strategy="hsdp", hsdp_shard_size=2)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8), len(VOCAB))
    trainer = Trainer(model, make_optimizer(model, cfg), CharDataset(torch.zeros(64, dtype=torch.uint8), 8),
                      config=cfg).setup()
    weight = trainer.module.blocks[0].fc.weight
    out = [f"{type(p).__name__}{getattr(p, 'dim', '')}" for p in weight.placements] + [tuple(weight.device_mesh.shape), tuple(weight.to_local().shape)]
    trainer.close()
    return out


def _on_four_ranks(tmp: str) -> dict:
    """The 4-rank job: hsdp vs ddp training (and its checkpoint), then the placements of a fresh hsdp model."""
    return {"train": _hsdp_and_ddp(tmp), "placements": _placements()}


def test_hsdp_on_2_replicas_of_2_shards_trains_like_ddp_and_resumes_on_2_ranks_under_each_strategy(tmp_path):
    four = run_on_ranks(_on_four_ranks, 4, args=(str(tmp_path),), timeout_s=420)  # one job: it starts 4 ranks
    ranks = [r["train"] for r in four]
    _assert_same_training(ranks[0], "hsdp 2x2")
    assert "hsdp_shard_size=3 does not divide the world size 4 into whole replicas; valid: 1, 2, 4" in ranks[0]["refused"]
    placements = [r["placements"] for r in four]
    for rank in placements:  # fc.weight is 64 x 16: 32 rows on each rank of a replica
        assert rank == ["Replicate", "Shard0", (2, 2), (32, 16)], rank

    step5 = tmp_path / "whole" / "checkpoints" / "step_00000005"
    assert ".metadata" in {p.name for p in step5.iterdir()}
    whole = ranks[0]["whole"]
    resumed = run_on_ranks(_resumed_on_2_ranks, 2, args=(str(tmp_path),), timeout_s=300)[0]
    for strategy, got in resumed.items():
        for key, value in whole.items():
            diff = (value - got[key]).abs().max().item()
            assert torch.allclose(value, got[key], rtol=1e-5, atol=1e-6), f"2x2 -> {strategy} on 2: {key} by {diff:.3g}"
