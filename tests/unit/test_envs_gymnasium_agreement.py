"""Our batched CartPole-v1 and Pendulum-v1 against gymnasium's own environments.

Both are driven from the same states with the same actions; each step's
observation, reward, terminated and truncated must agree. The initial states
of new episodes come from different random generators (ours is keyed by env
id, gymnasium's is a NumPy generator), so after every reset our fresh state is
copied into gymnasium's environment, and before every step gymnasium's state
is copied into ours: each transition is checked from identical states.
This pins the physics, the thresholds, the time limits and gymnasium 1.x's
autoreset (next-step by default, same-step on request).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multigpu as mg

gym = pytest.importorskip("gymnasium")


def _balancing_actions(obs: np.ndarray, rng: np.random.Generator, noise: float) -> np.ndarray:
    """A PD controller that keeps the pole up for 500 steps (so truncation happens), with random flips."""
    push_right = (obs[:, 2] + 0.5 * obs[:, 3] + 0.01 * obs[:, 0] + 0.1 * obs[:, 1]) > 0
    flip = rng.random(len(obs)) < noise
    return (push_right ^ flip).astype(np.int64)


@pytest.mark.parametrize("dtype, atol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_cartpole_matches_gymnasiums_vector_env_step_by_step(dtype, atol):
    """Next-step autoreset, termination at the thresholds and truncation at 500, against CartPoleVectorEnv."""
    n, steps = 24, 700
    rng = np.random.default_rng(0)
    theirs = gym.make_vec("CartPole-v1", num_envs=n, vectorization_mode="vector_entry_point")
    ours = mg.envs.make("CartPole-v1", num_envs=n, seed=0, dtype=dtype)
    assert ours.metadata["autoreset_mode"] == "next_step"
    assert theirs.metadata["autoreset_mode"] == gym.vector.AutoresetMode.NEXT_STEP
    their_obs, _ = theirs.reset(seed=0)
    ours.reset()
    g = theirs.unwrapped
    noise = np.where(np.arange(n) < n // 2, 0.0, 0.8)  # half balance to the time limit, half fall often
    obs = their_obs
    saw = {"terminated": 0, "truncated": 0, "autoreset": 0}
    prev_done = np.zeros(n, dtype=bool)
    for _ in range(steps):
        ours.state.copy_(torch.from_numpy(g.state))  # step from gymnasium's exact state
        actions = np.where(rng.random(n) < noise, rng.integers(0, 2, n), _balancing_actions(obs, rng, 0.0))
        o_obs, o_rew, o_term, o_trunc, o_info = ours.step(torch.from_numpy(actions))
        t_obs, t_rew, t_term, t_trunc, t_info = theirs.step(actions)
        # the environments that ended last step were reset in this one: new states differ by generator
        g.state[:, prev_done] = ours.state[:, torch.from_numpy(prev_done)].double().numpy()
        t_obs[prev_done] = o_obs[torch.from_numpy(prev_done)].float().numpy()
        np.testing.assert_allclose(o_obs.numpy(), g.state.T, atol=atol, rtol=0)  # their float64 state
        np.testing.assert_allclose(o_obs.numpy(), t_obs, atol=2e-6, rtol=0)  # their float32 observation
        np.testing.assert_array_equal(o_rew.numpy(), t_rew)
        np.testing.assert_array_equal(o_term.numpy(), t_term)
        np.testing.assert_array_equal(o_trunc.numpy(), t_trunc)
        np.testing.assert_array_equal(ours.elapsed_steps.numpy(), g.steps)
        assert o_info == t_info == {}
        saw["terminated"] += int(t_term.sum())
        saw["truncated"] += int(t_trunc.sum())
        saw["autoreset"] += int(prev_done.sum())
        prev_done = t_term | t_trunc
        obs = t_obs
    assert saw["terminated"] > 50 and saw["truncated"] >= n // 2 and saw["autoreset"] > 50, saw


def test_cartpole_same_step_autoreset_matches_sync_vector_env():
    """Same-step autoreset: the ending step returns the next episode's first obs, the last one in final_obs."""
    n, steps = 6, 400
    rng = np.random.default_rng(1)
    theirs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(n)],
                                      autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    ours = mg.envs.make("CartPole-v1", num_envs=n, seed=3, dtype=torch.float64,
                        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    theirs.reset(seed=0)
    ours.reset()
    inner = [e.unwrapped for e in theirs.envs]
    endings = 0
    for _ in range(steps):
        for i, e in enumerate(inner):
            ours.state[:, i] = torch.as_tensor(np.asarray(e.state, dtype=np.float64))
        actions = rng.integers(0, 2, n)
        o_obs, o_rew, o_term, o_trunc, o_info = ours.step(torch.from_numpy(actions))
        t_obs, t_rew, t_term, t_trunc, t_info = theirs.step(actions)
        done = t_term | t_trunc
        np.testing.assert_array_equal(o_term.numpy(), t_term)
        np.testing.assert_array_equal(o_trunc.numpy(), t_trunc)
        np.testing.assert_array_equal(o_rew.numpy(), t_rew)
        if done.any():
            endings += int(done.sum())
            np.testing.assert_array_equal(o_info["_final_obs"].numpy(), t_info["_final_obs"])
            for i in np.flatnonzero(done):
                np.testing.assert_allclose(o_info["final_obs"][i].numpy(), t_info["final_obs"][i], atol=1e-6)
                inner[i].state = ours.state[:, i].numpy().copy()  # their reset state <- ours
                t_obs[i] = inner[i].state
        np.testing.assert_allclose(o_obs.numpy(), t_obs, atol=1e-6, rtol=0)
    assert endings > 20


def test_pendulum_matches_gymnasium_including_the_200_step_limit():
    n, steps = 8, 450
    rng = np.random.default_rng(2)
    theirs = gym.vector.SyncVectorEnv([lambda: gym.make("Pendulum-v1") for _ in range(n)])
    ours = mg.envs.make("Pendulum-v1", num_envs=n, seed=5, dtype=torch.float64)
    theirs.reset(seed=0)
    ours.reset()
    inner = [e.unwrapped for e in theirs.envs]
    prev_done = np.zeros(n, dtype=bool)
    truncations = 0
    for _ in range(steps):
        for i, e in enumerate(inner):
            ours.state[:, i] = torch.as_tensor(e.state)
        actions = rng.uniform(-2.5, 2.5, size=(n, 1)).astype(np.float32)  # beyond the bounds: clipped
        o_obs, o_rew, o_term, o_trunc, _ = ours.step(torch.from_numpy(actions))
        t_obs, t_rew, t_term, t_trunc, _ = theirs.step(actions)
        for i in np.flatnonzero(prev_done):
            inner[i].state = ours.state[:, i].numpy().copy()
            t_obs[i] = o_obs[i].numpy()
        np.testing.assert_allclose(o_obs.numpy(), t_obs, atol=1e-6, rtol=0)
        np.testing.assert_allclose(o_rew.numpy(), t_rew, atol=1e-4, rtol=1e-6)
        np.testing.assert_array_equal(o_term.numpy(), t_term)
        np.testing.assert_array_equal(o_trunc.numpy(), t_trunc)
        truncations += int(t_trunc.sum())
        prev_done = t_term | t_trunc
    assert truncations == 2 * n  # episodes of 200 steps, plus the autoreset step each


def test_spaces_are_gymnasiums():
    cart = mg.envs.make("CartPole-v1", num_envs=3, seed=0)
    ref = gym.make("CartPole-v1")
    assert cart.single_observation_space == ref.observation_space
    assert cart.single_action_space == ref.action_space
    assert cart.action_space == gym.spaces.MultiDiscrete([2, 2, 2])
    assert cart.observation_space.shape == (3, 4)
    pend = mg.envs.make("Pendulum-v1", num_envs=2, seed=0)
    ref = gym.make("Pendulum-v1")
    assert pend.single_observation_space == ref.observation_space
    assert pend.single_action_space == ref.action_space
    obs, _ = cart.reset()
    assert all(cart.single_observation_space.contains(o) for o in obs.numpy())
