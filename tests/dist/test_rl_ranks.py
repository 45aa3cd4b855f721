"""PPO's cross-rank pieces on 2 real gloo ranks (one spawn, several checks).

* The observation normalizer's statistics, all-reduced at each ``sync``, are the same on every
  rank and equal to one process's over the concatenated data: otherwise ranks would feed the
  one DDP policy differently normalized inputs.
* A gymnasium vector environment from a factory that knows nothing of ranks is seeded by global
  env id (``seed + env_ids.start``, gymnasium's own ``seed + i``), so the split share of 2 ranks
  resets to the same observations as one process building all of them.
* A checkpoint resumes on another world size (an elastic job's restart after a node was lost or joined) with the
  same environments re-split, checked bit for bit and recorded as a resize.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def _ppo(run_dir: str, updates: int) -> dict:
    """A few PPO updates of 5 CartPole environments split over this job's ranks, continuing ``run_dir``'s
    newest checkpoint (a checkpoint after every update); every environment's state at the end, in id order."""
    from multigpu.rl import RLConfig
    from multigpu.rl.ppo import train
    from multigpu.run import script_context

    cfg = RLConfig(env_id="CartPole-v1", num_envs=NUM_ENVS, num_steps=8, total_env_steps=NUM_ENVS * 8 * updates,
                   target_return=None, num_minibatches=2, update_epochs=1, log_every=100, checkpoint_every=1,
                   keep_last=10, checkpoint_mode="sync")
    lines = []
    train(cfg, script_context(run_dir, resume="auto"), log=lines.append)
    return {"lines": lines}


def test_ppo_resumes_on_another_world_size_with_the_same_environments_re_split_and_records_the_resize(tmp_path):
    """An elastic rl job's restart at another size: every rank's saved environments (5, split 3+2 by 2 ranks) are
    re-split for 3 ranks (2+2+1) and then for 1, each time checked bit for bit against the digest saved with the
    checkpoint (the environments' state, the current observations, episode sums and pending resets, by id) and
    recorded as a resize. Before, a resume on another size stopped with "valid: resume rl on the same world size"."""
    from multigpu.runtime.context import read_resizes

    run = tmp_path / "run"
    run_on_ranks(_ppo, 2, args=(str(run), 3), timeout_s=120)
    three = run_on_ranks(_ppo, 3, args=(str(run), 5), timeout_s=120)
    one = run_on_ranks(_ppo, 1, args=(str(run), 7), timeout_s=120)[0]
    records = read_resizes(run)
    assert [(r["from_ranks"], r["to_ranks"], r["step"]) for r in records] == [(2, 3, 3), (3, 1, 5)], records
    for entry in records:
        check = entry["check"]
        manifest = json.loads((Path(entry["checkpoint"]) / "manifest.json").read_text())
        assert check["equal"] and check["bit_exact"] and check["parts"] == ["envs"], entry
        assert check["saved_digest"] == check["loaded_digest"] == manifest["meta"]["env_digest"], entry
        assert check["loaded_digest"].endswith(f"-{NUM_ENVS}")
    digest = records[0]["check"]["loaded_digest"]
    assert three[0]["lines"][0] == (f"multigpu rl: resized from 2 to 3 rank(s) at update 3: the state loaded equals "
                                    f"the saved one, bit for bit (digest {digest})")
    assert three[0]["lines"][1].startswith("resumed at update 3 of 5")
    assert one["lines"][0].startswith("multigpu rl: resized from 3 to 1 rank(s) at update 5: the state loaded equals")
    assert json.loads((run / "checkpoints" / "step_00000007" / "manifest.json").read_text())["world_size"] == 1


def _count_collectives(updates: int) -> dict:
    """PPO on this job's ranks for ``updates`` updates, counting torch's collective calls by name."""
    import collections

    import torch.distributed as dist

    from multigpu.rl import RLConfig
    from multigpu.rl import ppo

    counts: collections.Counter = collections.Counter()
    in_updates: dict = {}
    close = ppo.Run.close

    def snapshot_then_close(run, *args, **kwargs):  # the updates' collectives, not the run's summary at the end
        in_updates.update(counts)
        return close(run, *args, **kwargs)

    ppo.Run.close = snapshot_then_close
    for name in ("all_reduce", "all_gather", "all_gather_object", "gather_object", "broadcast", "barrier"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    cfg = RLConfig(env_id="CartPole-v1", num_envs=NUM_ENVS, num_steps=32, total_env_steps=NUM_ENVS * 32 * updates,
                   target_return=None, num_minibatches=2, update_epochs=3, log_every=1000, checkpoint_every=0)
    ppo.train(cfg, None, log=lambda *_: None)
    return in_updates


def test_ppo_makes_one_gradient_all_reduce_per_minibatch_and_one_returns_gather_per_update():
    """The collectives of a 2-rank PPO update on CPU: DDP's one all-reduce of every gradient per minibatch (one
    bucket, not one per parameter) and one all-gather of the episodes' returns, started after the rollout and
    waited for after the update (a fixed-size tensor: no pickled objects, no second collective for the sizes).
    Before, the returns went through ``all_gather_object`` (two collectives and a pickle per update), waited
    for before the update."""
    updates = 3
    counts = run_on_ranks(_count_collectives, 2, args=(updates,), timeout_s=120)
    for rank_counts in counts:
        assert rank_counts.get("all_gather_object", 0) == 0, rank_counts
        assert rank_counts.get("all_gather", 0) == updates, rank_counts
        assert rank_counts.get("all_reduce", 0) == updates * 3 * 2, rank_counts
