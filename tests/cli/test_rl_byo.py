"""Bring your own environment to `multigpu rl`: factories from this test file on 2 ranks, bad input, Pendulum.

The factories below live outside the package: `multigpu rl --env tests.cli.test_rl_byo:make_reach`
imports them in the launcher (to read the spaces) and in every rank, as it would a user's module.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import numpy as np
import pytest
import torch

from multigpu.cli import main
from multigpu.envs import spaces
from multigpu.envs.split import stream_keys, uniforms
from tests.conftest import ROOT, run_cli

HERE = "tests.cli.test_rl_byo"
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}


class Reach:
    """Push a point in the plane towards the origin: obs = position, action = velocity in [-1, 1]^2 (a Box),
    reward = -distance, truncated after ``horizon`` steps. Torch tensors on ``device``; gymnasium's
    default next-step autoreset; starting points keyed by (seed, global env id, reset count), so a
    rank's share starts where one process's would."""

    metadata = {"autoreset_mode": "NextStep"}

    def __init__(self, env_ids: range, seed: int, device: torch.device, size: float = 1.0, horizon: int = 16):
        self.num_envs, self.device, self.size, self.horizon = len(env_ids), device, size, horizon
        self.env_ids = torch.as_tensor(list(env_ids))
        self.keys = stream_keys(seed, self.env_ids)
        self.single_observation_space = spaces.box(-np.inf, np.inf, (2,), np.float32)
        self.single_action_space = spaces.box(-1.0, 1.0, (2,), np.float32)
        self.pos = torch.zeros(self.num_envs, 2, device=device)
        self.t = torch.zeros(self.num_envs, dtype=torch.int64, device=device)
        self.resets = torch.zeros(self.num_envs, dtype=torch.int64)
        self.ended = torch.zeros(self.num_envs, dtype=torch.bool, device=device)

    def _reset(self, mask: torch.Tensor) -> None:
        start = (uniforms(self.keys, self.resets, 2).T * 2 - 1) * self.size
        self.pos[mask] = start.to(self.device)[mask]
        self.t[mask] = 0
        self.resets += mask.cpu()

    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.keys = stream_keys(seed, self.env_ids)
        self._reset(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        self.ended.zero_()
        return self.pos.clone(), {}

    def step(self, actions: torch.Tensor):
        assert isinstance(actions, torch.Tensor) and actions.shape == (self.num_envs, 2)
        assert actions.abs().max() <= 1.0  # clipped into the Box by the policy's action map
        restart = self.ended.clone()
        self.pos += 0.1 * actions
        self.t += 1
        reward = -self.pos.norm(dim=1)
        truncated = self.t >= self.horizon
        if restart.any():  # next-step autoreset: these ended last step; this step only resets them
            self._reset(restart)
            reward[restart], truncated[restart] = 0.0, False
        self.ended = truncated.clone()
        return self.pos.clone(), reward, torch.zeros_like(truncated), truncated, {}


def make_reach(env_ids: range, seed: int, device: torch.device, size: float = 1.0) -> Reach:
    """A torch-vectorized continuous environment (the factory takes env_ids: its streams are split-independent)."""
    return Reach(env_ids, seed, device, size)


def make_gym(num_envs: int, autoreset_mode: str, env: str = "Pendulum-v1"):
    """A NumPy environment: gymnasium's own vector env (it steps in Python), asked for same-step autoreset."""
    import gymnasium

    mode = {"same_step": gymnasium.vector.AutoresetMode.SAME_STEP}.get(autoreset_mode,
                                                                       gymnasium.vector.AutoresetMode.NEXT_STEP)
    return gymnasium.make_vec(env, num_envs=num_envs, vectorization_mode="sync", vector_kwargs={"autoreset_mode": mode})


def make_multi_discrete(num_envs: int):
    """CartPole with a MultiDiscrete([2, 2]) action space: one PPO does not act in."""
    import gymnasium

    class TwoButtons(gymnasium.ActionWrapper):
        def __init__(self, inner):
            super().__init__(inner)
            self.action_space = gymnasium.spaces.MultiDiscrete([2, 2])

        def action(self, action):
            return int(action[0])

    return gymnasium.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync", wrappers=[TwoButtons])


def make_unbounded(num_envs: int, seed: int, device: torch.device) -> Reach:
    env = Reach(range(num_envs), seed, device)
    env.single_action_space = spaces.box(-np.inf, np.inf, (2,), np.float32)
    return env


def _summary(run_dir) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.e2e
def test_a_torch_env_factory_with_next_step_autoreset_trains_on_two_ranks(tmp_path):
    """Box actions (Gaussian policy), kwargs, obs_norm, and the next-step reset steps left out of the batch."""
    proc = run_cli("rl", "--env", f"{HERE}:make_reach", "env.kwargs.size=2.0", "--obs-norm", "--nproc-per-node", "2",
                   "--run-dir", str(tmp_path), "num_envs=32", "num_steps=32", "total_env_steps=4096",
                   "target_return=null", "num_minibatches=2", "update_epochs=2", "log_every=1", env=ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"not solved {HERE}:make_reach" in proc.stdout and "after 4,096 env-steps and 4 updates" in proc.stdout
    config = json.loads((tmp_path / "run.json").read_text())["config"]
    assert config["env"] == {"factory": f"{HERE}:make_reach", "kwargs": {"size": 2.0}} and config["obs_norm"]
    summary = _summary(tmp_path)
    assert summary["items"] == 3 * 32 * 32 and [r["items"] for r in summary["per_rank"]] == [3 * 16 * 32] * 2
    rl = summary["rl"]
    # 128 steps per env, each episode 16 steps and then one step that only resets it: 7 episodes per env
    assert rl["env"] == f"{HERE}:make_reach" and rl["episodes"] == 32 * 7
    assert -100 < rl["mean_return"] < 0
    norm = rl["obs_norm"]
    assert norm["count"] == 32 * (1 + 4 * 32) and len(norm["mean"]) == 2 and all(v > 0 for v in norm["var"])


@pytest.mark.e2e
def test_a_numpy_gymnasium_env_trains_on_two_ranks(tmp_path):
    """gymnasium's own SyncVectorEnv (NumPy, same-step autoreset, object-array final_obs), tanh-squashed actions."""
    pytest.importorskip("gymnasium")
    proc = run_cli("rl", "--env", f"{HERE}:make_gym", "--nproc-per-node", "2", "--run-dir", str(tmp_path),
                   "num_envs=8", "num_steps=64", "total_env_steps=2048", "target_return=null", "action_bounds=tanh",
                   "num_minibatches=2", "update_epochs=1", env=ENV, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(tmp_path)
    assert summary["items"] == 3 * 8 * 64 and summary["rl"]["updates"] == 4
    assert summary["rl"]["episodes"] == 8  # 256 steps of 200-step episodes: each env truncated once
    assert -3300 < summary["rl"]["mean_return"] < 0 and summary["rl"]["obs_norm"] is None


@pytest.mark.parametrize("argv, message", [
    (["--env", f"{HERE}:nope"], f"env.factory '{HERE}:nope': '{HERE}' has no callable 'nope'; callables there: "),
    (["--env", "nopkg.envs:make"], "env.factory 'nopkg.envs:make': module 'nopkg.envs' does not import "
                                   "(ModuleNotFoundError: No module named 'nopkg'); give package.module:name"),
    (["--env", f"{HERE}:make_reach", "env.kwargs.sise=2"],
     f"env.factory '{HERE}:make_reach' takes no argument 'sise' (from env.kwargs); valid: env_ids, seed, device, size"),
    (["--env", f"{HERE}:make_unbounded", "action_bounds=tanh"],
     f"env.factory '{HERE}:make_unbounded' has an action space without finite bounds"),
    (["--env", f"{HERE}:make_multi_discrete"],
     f"env.factory '{HERE}:make_multi_discrete' has action space MultiDiscrete([2 2]); valid: Discrete or Box"),
    (["env_id=Pendulm-v1"], "rl.env_id: unknown environment 'Pendulm-v1'. Did you mean 'Pendulum-v1'?"),
    (["num_envs=3", "--nproc-per-node", "2", "num_steps=1", "num_minibatches=2"],
     "rl: the smallest rank's rollout (1 envs x 1 steps = 1) is too small for num_minibatches=2 (at least 4)"),
    (["--env", f"{HERE}:make_reach", "num_envs=2", "num_steps=2", "num_minibatches=2"],
     "rollout (2 envs x 2 steps = 4) is too small for num_minibatches=2 (at least 8 with next-step autoreset)"),
], ids=["no-such-factory", "no-such-module", "unknown-kwarg", "tanh-without-bounds", "multi-discrete",
        "unknown-env-id", "minibatch-too-small", "minibatch-too-small-next-step"])
def test_bad_input_is_one_line_and_exit_2_before_anything_starts(argv, message, tmp_path, capsys, monkeypatch):
    if "make_multi_discrete" in argv[-1]:
        pytest.importorskip("gymnasium")
    tripwire = mock.Mock(side_effect=AssertionError("bad input reached torch's launcher"))
    monkeypatch.setattr("multigpu.launch.agent._elastic_launch", tripwire)
    code = main(["rl", "-f", "ppo-pendulum", "--run-dir", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert message in err, err
    assert not (tmp_path / "run").exists()
    tripwire.assert_not_called()


@pytest.mark.slow
def test_ppo_solves_pendulum_on_two_ranks(tmp_path):
    """The bar: mean return >= -250 over the last 100 episodes, 2 CPU ranks, the shipped preset."""
    proc = run_cli("rl", "-f", "ppo-pendulum", "--nproc-per-node", "2", "--run-dir", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rl = _summary(tmp_path)["rl"]
    assert rl["solved"] and rl["mean_return"] >= -250 and rl["world_size"] == 2, rl
    assert rl["env_steps"] <= 500_000, rl  # seeds 1-4 took 197k-262k (benchmarks/RESULTS.md)
