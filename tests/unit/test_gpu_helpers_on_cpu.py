"""The GPU tests' helpers, run on the CPU so they never rot between GPU runs.

tests/gpu/ compares a CUDA run with a CPU run through these helpers; here both
sides are CPU runs (or the premise a GPU test relies on, such as a loss that
falls within its step budget in every precision), so a broken helper fails
here, on every machine, instead of first on a scarce GPU.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import multigpu as mg
from multigpu.testing import run_on_ranks
from tests.gpu import test_envs_gpu, test_infer_gpu, test_monitor_doctor_gpu, test_sim_gpu, test_train_gpu


@pytest.fixture
def alone(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    mg.init(backend="cpu", threads=1)
    yield
    mg.shutdown()


def test_train_helper_learns_in_every_precision_within_the_gpu_tests_budget(alone):
    t = test_train_gpu
    for precision in ("fp32", "bf16", "fp16"):
        result = t.train(dataclasses.replace(t.LEARN, precision=precision), t.text_tokens())
        assert result["device"] == "cpu" and t.loss_fell(result["losses"]), (precision, result["losses"])
    a = t.train(t.EXACT, t.random_tokens())
    b = t.train(t.EXACT, t.random_tokens())
    t.assert_close(a["state"], b["state"], "two identical runs", rtol=0, atol=0)
    moved = {k: v + (1e-3 if k == "tok.weight" else 0) for k, v in a["state"].items()}
    assert t.max_diff(a["state"], moved)[0] == "tok.weight"
    with pytest.raises(AssertionError, match="tok.weight"):
        t.assert_close(a["state"], moved, "moved", rtol=1e-6, atol=1e-7)


def _two_rank_runs(configs: list, summing: bool) -> list[dict]:
    """Rank body: ``test_train_gpu.train`` of each config on 2 ranks; with ``summing``, DDP's all-reduce sums the
    ranks' gradients instead of averaging them (its hook divides by 1, not by the world size)."""
    if summing:
        from multigpu.train import strategies

        real = strategies.CommTimer.__init__
        strategies.CommTimer.__init__ = lambda self, group, world_size: real(self, group, 1)
    return [test_train_gpu.train(cfg, test_train_gpu.random_tokens()) for cfg in configs]


@pytest.mark.dist
def test_train_helper_tells_summed_gradients_from_averaged():
    """What the GPU tests' comparison of two training runs must see: 2 ranks whose DDP sums the gradients where it
    should average them. The weights alone cannot always show it: where both runs' gradient norms are clipped
    (here at 0.1: 0.56 averaged, 1.12 summed) both apply the same clipped gradients, and the weights agree bit
    for bit; under EXACT (clipped at 1) they differ only because one run is clipped and the other not. The
    gradients (each step's norm before clipping, the first step's applied gradient) show the x2 in both."""
    t = test_train_gpu
    configs = [t.EXACT, dataclasses.replace(t.EXACT, grad_clip=0.1)]
    averaged = run_on_ranks(_two_rank_runs, 2, args=(configs, False), timeout_s=300)[0]
    summed = run_on_ranks(_two_rank_runs, 2, args=(configs, True), timeout_s=300)[0]
    for cfg, a, s in zip(configs, averaged, summed, strict=True):
        t.assert_same_training(a, a, "a run with itself")
        with pytest.raises(AssertionError, match="gradient"):
            t.assert_same_training(s, a, f"summed vs averaged, grad_clip={cfg.grad_clip}")


def test_sim_helper_sees_equal_and_different_runs():
    s = test_sim_gpu
    cfg = dataclasses.replace(s.CASES["sir"], agents=20_011, steps=6, chunk_size=4096)
    one = s.outcome_alone(cfg, "cpu")
    s.assert_same(s.outcome_alone(dataclasses.replace(cfg, chunk_size=1 << 20), "cpu"), one, "chunking")
    with pytest.raises(AssertionError, match="final agents differ"):
        s.assert_same(s.outcome_alone(dataclasses.replace(cfg, seed=1), "cpu"), one, "another seed")


def test_envs_helper_reports_identical_trajectories_as_zero():
    for env_id in ("CartPole-v1", "Pendulum-v1"):
        same = test_envs_gpu.compare_trajectories(env_id, "cpu", "cpu", num_envs=256, steps=40, dtype=torch.float32)
        assert same == {"max_obs_diff": 0.0, "max_reward_diff": 0.0, "apart_share": 0.0}


def test_infer_and_sampler_helpers_on_cpu(tmp_path):
    out = test_infer_gpu.ours("cpu")
    assert out.shape == (1, 3, 333, 410) and torch.isfinite(out).all()
    from multigpu.monitor import Sampler

    with Sampler(tmp_path, interval_s=0.05, gpus=False) as sampler:
        torch.randn(256, 256) @ torch.randn(256, 256)
    seen = test_monitor_doctor_gpu.gpu_figures(sampler.path)
    assert seen["samples"] >= 2 and seen["with_gpus"] == 0 and seen["util_max"] == 0
