"""PPO's cross-rank pieces on 2 real gloo ranks (one spawn, several checks).

* The observation normalizer's statistics, all-reduced at each ``sync``, are the same on every
  rank and equal to one process's over the concatenated data: otherwise ranks would feed the
  one DDP policy differently normalized inputs.
* A gymnasium vector environment from a factory that knows nothing of ranks is seeded by global
  env id (``seed + env_ids.start``, gymnasium's own ``seed + i``), so the split share of 2 ranks
  resets to the same observations as one process building all of them.
"""

from __future__ import annotations

import pytest
import torch

import multigpu as mg
from multigpu.rl.normalize import ObsNormalizer
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

NUM_ENVS = 5


def make_gym_pendulum(num_envs: int):
    import gymnasium

    return gymnasium.make_vec("Pendulum-v1", num_envs=num_envs, vectorization_mode="sync")


def _data(part: int) -> torch.Tensor:
    """Rollout ``part`` of the global data: rank r observes rows [r*n, (r+1)*n) of each part (uneven scales)."""
    gen = torch.Generator().manual_seed(part)
    return torch.randn(2 * 37, 3, generator=gen) * torch.tensor([2.0, 0.01, 30.0]) + torch.tensor([5.0, -1e3, 0.0])


def _body() -> dict:
    rank = mg.rank()
    norm = ObsNormalizer(3)
    stats = []
    for part in range(3):
        norm.observe(_data(part)[rank * 37:(rank + 1) * 37])
        norm.sync()
        stats.append((norm.count, norm.mean.clone(), norm.var.clone()))
    envs = mg.envs.make(f"{__name__}:make_gym_pendulum", num_envs=NUM_ENVS, seed=0, split=True)
    obs, _ = envs.reset(seed=7)
    return {"stats": stats, "obs": mg.gather(obs, dst=0)}


def test_normalizer_statistics_and_factory_seeding_do_not_depend_on_the_split():
    pytest.importorskip("gymnasium")
    results = run_on_ranks(_body, 2, timeout_s=120)
    for part, (count, mean, var) in enumerate(results[0]["stats"]):
        data = torch.cat([_data(p) for p in range(part + 1)]).double()
        assert count == len(data)
        assert torch.allclose(mean, data.mean(0), rtol=1e-12, atol=1e-9)
        assert torch.allclose(var, data.var(0, unbiased=False), rtol=1e-9)
        other = results[1]["stats"][part]
        assert other[0] == count and torch.equal(other[1], mean) and torch.equal(other[2], var)  # bit-identical
    one = mg.envs.make(f"{__name__}:make_gym_pendulum", num_envs=NUM_ENVS, seed=0)
    assert torch.equal(results[0]["obs"], one.reset(seed=7)[0])  # 3 + 2 envs on 2 ranks = 5 in one process
