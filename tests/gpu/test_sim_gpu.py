"""The simulation on CUDA is bit-identical to the simulation on the CPU.

An agent's update is integer arithmetic on counter-based random numbers and
exactly summed fields, so the device must not matter: the same final
``state_digest`` (a hash of every agent) and the same per-step series, for
every model, eagerly and under torch.compile (Triton kernels), on one rank and
split over 2 GPU ranks (NCCL on 2 GPUs, gloo on one shared GPU).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import multigpu as mg
from multigpu.runtime.context import RunContext
from multigpu.sim import SimConfig, run
from multigpu.testing import requires_gpus, run_on_ranks

pytestmark = pytest.mark.gpu

SIR = SimConfig(model="sir", agents=300_007, grid=(96, 128), steps=20, chunk_size=1 << 16, plot=False,
                params={"beta": 0.3, "radius": 1, "seir": True, "initial_infected": 0.01, "move_prob": 0.7})
CASES = {
    "sir": SIR,
    "sir-compiled": dataclasses.replace(SIR, compile=True),
    "movement": SimConfig(model="movement", agents=200_003, grid=(64, 64), steps=10, chunk_size=1 << 16, plot=False),
    "market": SimConfig(model="market", agents=200_003, steps=20, chunk_size=1 << 16, plot=False),
}


def outcome(cfg: SimConfig) -> dict | None:
    """Rank 0's series and digest of a run of ``cfg`` on every rank of the current job (None elsewhere)."""
    result = run(cfg)
    if result is None:
        return None
    return {"series": result.series, "digest": result.summary["state_digest"]}


def outcome_alone(cfg: SimConfig, backend: str) -> dict:
    """``outcome`` in this process alone on ``backend`` ("cpu" or "cuda")."""
    mg.init(backend=backend)
    try:
        return outcome(cfg)
    finally:
        mg.shutdown()


def assert_same(a: dict, b: dict, what: str) -> None:
    assert a["digest"] == b["digest"], f"{what}: final agents differ ({a['digest']} vs {b['digest']})"
    for name in a["series"]:
        first = next((i for i, (x, y) in enumerate(zip(a["series"][name], b["series"][name], strict=True)) if x != y), None)
        assert first is None, f"{what}: series {name!r} first differs at step {first + 1}"


@requires_gpus(1)
@pytest.mark.parametrize("case", list(CASES))
def test_one_cuda_rank_is_bit_identical_to_the_cpu(case, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    cfg = CASES[case]
    cpu = outcome_alone(dataclasses.replace(cfg, compile=False), "cpu")
    cuda = outcome_alone(cfg, "cuda")
    assert_same(cuda, cpu, f"{case}: CUDA vs CPU")
    assert len(cuda["series"]["step"]) == cfg.steps


@requires_gpus(1)
def test_spatial_split_over_two_gpu_ranks_matches_one_cpu_rank(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    placement = ({"env": {"CUDA_VISIBLE_DEVICES": "0,1"}} if torch.cuda.device_count() >= 2 else  # else --share-gpus
                 {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "ctx": RunContext(isolated=True, pg_backend="gloo")})
    for strategy in ("spatial", "adaptive"):
        cfg = dataclasses.replace(SIR, strategy=strategy, rebalance_every=5)
        ranks = run_on_ranks(outcome, 2, args=(cfg,), backend="cuda", **placement, timeout_s=300)
        assert_same(ranks[0], outcome_alone(SIR, "cpu"), f"{strategy} on 2 GPU ranks vs data on 1 CPU rank")
