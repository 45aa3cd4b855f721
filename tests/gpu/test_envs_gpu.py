"""CartPole and Pendulum on CUDA follow the CPU's trajectories within float tolerance.

Resets draw the same bits on every device (counter-based streams); the
dynamics are the same float ops, but CUDA's sin/cos may round differently
from the CPU's, so observations agree to a tolerance. In float64 that
tolerance is tiny and no episode may end on a different step; in float32 a
pole balanced on a threshold may, rarely, so the share of such (env, step)
pairs is bounded and the others must still agree.
"""

from __future__ import annotations

import pytest
import torch

import multigpu as mg
from multigpu.testing import requires_gpus

pytestmark = pytest.mark.gpu


def actions_for(env_id: str, num_envs: int, steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    if env_id == "CartPole-v1":
        return [torch.randint(0, 2, (num_envs,), generator=gen) for _ in range(steps)]
    return [4 * torch.rand(num_envs, 1, generator=gen, dtype=torch.float64) - 2 for _ in range(steps)]


def compare_trajectories(env_id: str, device_a: str, device_b: str, *, num_envs: int = 4096, steps: int = 300,
                         dtype: torch.dtype = torch.float64) -> dict:
    """Step the same environments on two devices with the same actions; how far apart they end.

    Returns the largest observation and reward difference over (env, step) pairs whose
    episodes have ended on the same steps so far, and the share of pairs where they have not.
    """
    a = mg.envs.make(env_id, num_envs=num_envs, device=device_a, seed=11, dtype=dtype)
    b = mg.envs.make(env_id, num_envs=num_envs, device=device_b, seed=11, dtype=dtype)
    obs_a, obs_b = a.reset()[0].cpu(), b.reset()[0].cpu()
    agree = torch.ones(num_envs, dtype=torch.bool)
    worst_obs = (obs_a - obs_b).abs().max().item()
    worst_reward, pairs_apart = 0.0, 0
    for act in actions_for(env_id, num_envs, steps):
        oa, ra, ta, ua, _ = (x.cpu() if isinstance(x, torch.Tensor) else x for x in a.step(act.to(device_a)))
        ob, rb, tb, ub, _ = (x.cpu() if isinstance(x, torch.Tensor) else x for x in b.step(act.to(device_b)))
        agree &= (ta == tb) & (ua == ub)
        pairs_apart += int((~agree).sum())
        if agree.any():
            worst_obs = max(worst_obs, (oa[agree] - ob[agree]).abs().max().item())
            worst_reward = max(worst_reward, (ra[agree] - rb[agree]).abs().max().item())
    return {"max_obs_diff": worst_obs, "max_reward_diff": worst_reward, "apart_share": pairs_apart / (num_envs * steps)}


@requires_gpus(1)
@pytest.mark.parametrize("env_id,steps,tol32", [
    ("CartPole-v1", 300, 1e-3),  # episodes last ~20 steps: errors never grow far
    ("Pendulum-v1", 60, 2e-2),   # never terminates; near upright an error grows ~1.2x a step, so a short horizon
])
def test_cuda_trajectories_match_the_cpu(env_id, steps, tol32):
    exact = compare_trajectories(env_id, "cuda", "cpu", steps=steps, dtype=torch.float64)
    assert exact["apart_share"] == 0.0, exact  # no episode ends on a different step in float64
    assert exact["max_obs_diff"] < 1e-9 and exact["max_reward_diff"] < 1e-5, exact  # rewards are float32
    single = compare_trajectories(env_id, "cuda", "cpu", steps=steps, dtype=torch.float32)
    assert single["apart_share"] < 1e-3, single
    assert single["max_obs_diff"] < tol32 and single["max_reward_diff"] < 5 * tol32, single
