"""Split-independence: the same global environments give bit-identical trajectories on 1, 2 and 3 ranks.

Each rank builds its share of ``num_envs`` (``split=True``), steps it with the
actions of its global env ids, and rank 0 gathers every observation, reward
and flag in env-id order. The gathered trajectories must equal, bit for bit,
a single process stepping all environments. 37 environments make uneven
shards (13/12/12 on 3 ranks); short time limits and random actions make
environments terminate, truncate and autoreset at different steps on
different ranks. This pins DESIGN invariant 2 for environments: randomness is
keyed by (seed, global env id, reset count), never by rank.
"""

from __future__ import annotations

import functools

import pytest
import torch

import multigpu as mg
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

NUM_ENVS, STEPS = 37, 150
CASES = [("CartPole-v1", "next_step", 60), ("CartPole-v1", "same_step", 45), ("Pendulum-v1", "next_step", 50)]


def _global_actions(env_id: str, step: int) -> torch.Tensor:
    """The actions of all NUM_ENVS environments at ``step``: a pure function of the step, the same on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    if env_id == "CartPole-v1":
        return torch.randint(0, 2, (NUM_ENVS,), generator=gen)
    return torch.rand(NUM_ENVS, 1, generator=gen) * 4 - 2


def _rollout(env_id: str, mode: str, limit: int, *, split: bool) -> torch.Tensor:
    """(local envs, STEPS + 1, features): obs, reward, terminated, truncated (and final_obs in same_step mode)."""
    envs = mg.envs.make(env_id, num_envs=NUM_ENVS, seed=2024, split=split, autoreset_mode=mode,
                        max_episode_steps=limit)
    obs, _ = envs.reset()
    n = envs.num_envs
    rows = [torch.cat([obs, torch.zeros(n, 3 + obs.shape[1])], 1)]
    for step in range(STEPS):
        obs, reward, terminated, truncated, info = envs.step(_global_actions(env_id, step)[envs.env_ids])
        # final_obs rows count only where _final_obs is set (the key is absent when no env of the shard ended)
        final = torch.where(info["_final_obs"][:, None], info["final_obs"], 0.0) if info else torch.zeros_like(obs)
        rows.append(torch.cat([obs, reward[:, None], terminated[:, None], truncated[:, None], final], 1))
    return torch.stack(rows, 1)


@functools.cache
def _single_process() -> dict:
    return {case: _rollout(*case, split=False) for case in CASES}


def _split_body() -> dict:
    out = {}
    for case in CASES:
        out[case] = mg.gather(_rollout(*case, split=True), dst=0)
    # the env ids are an exact partition; an unseeded split draws one seed for all ranks
    envs = mg.envs.make("CartPole-v1", num_envs=NUM_ENVS, split=True)
    out["ids"] = mg.gather(envs.env_ids, dst=0)
    out["seeds"] = mg.gather([envs.seed], dst=0)
    out["threads"] = torch.get_num_threads()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_trajectories_are_bit_identical_whatever_the_number_of_ranks(world_size):
    results = run_on_ranks(_split_body, world_size, timeout_s=180)
    root = results[0]
    reference = _single_process()
    for case in CASES:
        got = root[case]
        assert got.shape == reference[case].shape == (NUM_ENVS, STEPS + 1, got.shape[2])
        assert torch.equal(got, reference[case]), f"{case} differs on {world_size} ranks"
    assert root["ids"].tolist() == list(range(NUM_ENVS))
    assert len(set(root["seeds"])) == 1
    assert all(r["threads"] == 1 for r in results)
    # the rollouts did exercise terminations, truncations and autoresets on every shard
    cart = reference[("CartPole-v1", "next_step", 60)]
    assert cart[:, :, 5].sum() > 100 and cart[:, :, 6].sum() > 0
    # 50 steps, then the autoreset step: truncated at steps 50 and 101 of 150
    assert reference[("Pendulum-v1", "next_step", 50)][:, :, 5].sum() == NUM_ENVS * 2
