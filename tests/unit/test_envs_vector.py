"""The vector API without gymnasium in the loop: seeding, reset masks, streams, errors, the NumPy adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import multigpu as mg
from multigpu.envs import spaces
from multigpu.envs.split import env_id_range, mix32, mix32_np, stream_keys, uniforms, uniforms_np
from multigpu.errors import ConfigError


def _lowbias32_reference(x: int) -> int:
    """lowbias32 in plain Python integers (the published definition)."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_int64_and_uint32_hashes_are_lowbias32_bit_for_bit():
    """The overflow-free int64 form (GPU/dense path) and the uint32 form (CPU path) must be the same function."""
    values = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, *np.random.default_rng(0).integers(0, 2**32, 200)]
    expected = [_lowbias32_reference(int(v)) for v in values]
    assert mix32(torch.tensor(values, dtype=torch.int64)).tolist() == expected
    assert mix32_np(np.array(values, dtype=np.uint32)).tolist() == expected
    keys = stream_keys(7, torch.arange(1000))
    counts = torch.randint(0, 2**40, (1000,))  # reset counts beyond 32 bits wrap the same way
    a = uniforms(keys, counts, 4, torch.float64)
    b = uniforms_np(keys.numpy().astype(np.uint32), counts.numpy(), 4)
    assert torch.equal(a, torch.from_numpy(b).double())
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0
    assert abs(float(a.mean()) - 0.5) < 0.02  # 4000 draws: a gross bias would show
    assert stream_keys(7, torch.arange(5)).unique().numel() == 5
    assert not torch.equal(stream_keys(7, torch.arange(5)), stream_keys(8, torch.arange(5)))


def test_env_id_range_is_the_shard_of_global_ids():
    parts = [env_id_range(10, rank=r, world_size=3) for r in range(3)]
    assert parts == [range(0, 4), range(4, 7), range(7, 10)]
    assert env_id_range(2, rank=2, world_size=3) == range(2, 2)


def test_reset_seed_restarts_every_stream_and_a_subset_sees_the_same_numbers():
    envs = mg.envs.make("CartPole-v1", num_envs=6, seed=11)
    first, info = envs.reset(seed=3)
    assert info == {} and first.shape == (6, 4) and first.dtype == torch.float32
    assert float(first.abs().max()) < 0.05
    second, _ = envs.reset()  # the streams continue: new states
    assert not torch.equal(first, second)
    again, _ = envs.reset(seed=3)
    assert torch.equal(first, again)
    # environments 2..4 alone, as another rank would hold them, start from the same states
    part = mg.envs.CartPole(range(2, 5), seed=3)
    assert torch.equal(part.reset()[0], first[2:5])


def test_reset_mask_resets_only_the_masked_environments():
    envs = mg.envs.make("CartPole-v1", num_envs=4, seed=0)
    envs.reset(seed=0)
    for _ in range(5):
        envs.step(torch.ones(4, dtype=torch.int64))
    before = envs.state.clone()
    obs, _ = envs.reset(options={"reset_mask": np.array([True, False, False, True])})
    assert torch.equal(obs[1:3], before.T[1:3])
    assert not torch.equal(obs[0], before.T[0]) and float(obs[[0, 3]].abs().max()) < 0.05
    assert envs.elapsed_steps.tolist() == [0, 5, 5, 0]
    with pytest.raises(ConfigError, match=r"reset_mask has shape \(2,\); expected \(4,\)"):
        envs.reset(options={"reset_mask": [True, False]})


def test_next_step_autoreset_and_the_time_limit():
    envs = mg.envs.make("CartPole-v1", num_envs=2, seed=0, max_episode_steps=3)
    envs.reset(seed=0)
    flags = []
    for _ in range(8):
        _, reward, terminated, truncated, _ = envs.step(torch.tensor([0, 1]))
        flags.append((reward.tolist(), truncated.tolist()))
    # 3 steps, the autoreset step (reward 0, no flags), 3 steps, ...
    assert flags[2] == ([1.0, 1.0], [True, True])
    assert flags[3] == ([0.0, 0.0], [False, False])
    assert flags[6] == ([1.0, 1.0], [True, True])


def test_disabled_autoreset_keeps_stepping_until_reset():
    envs = mg.envs.make("Pendulum-v1", num_envs=3, seed=0, autoreset_mode="disabled", max_episode_steps=2)
    envs.reset()
    for _ in range(3):
        obs, reward, terminated, truncated, info = envs.step(torch.zeros(3, 1))
    assert truncated.all() and not terminated.any() and info == {}
    assert envs.elapsed_steps.tolist() == [3, 3, 3]
    assert obs.shape == (3, 3) and reward.dtype == torch.float32


def test_bad_input_names_what_is_valid():
    with pytest.raises(ConfigError, match="unknown environment 'CartPole-v0'. Did you mean 'CartPole-v1'"):
        mg.envs.make("CartPole-v0", num_envs=2)
    with pytest.raises(ConfigError, match="num_envs=0 must be a whole number >= 1"):
        mg.envs.make("CartPole-v1", num_envs=0)
    with pytest.raises(ConfigError, match="autoreset_mode='later' is not valid; valid: next_step, same_step, disabled"):
        mg.envs.make("CartPole-v1", num_envs=2, autoreset_mode="later")
    envs = mg.envs.make("CartPole-v1", num_envs=2, seed=0)
    with pytest.raises(ConfigError, match=r"got actions of shape \(3,\); expected \(2, ...\)"):
        envs.step(torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ConfigError, match="seed=\\[1, 2\\] must be one int"):
        envs.reset(seed=[1, 2])
    assert "CartPole-v1" in mg.envs.registered_ids() and "Pendulum-v1" in mg.envs.registered_ids()


def test_numpy_adapter_gives_arrays():
    envs = mg.envs.NumpyVectorEnv(mg.envs.make("CartPole-v1", num_envs=3, seed=0))
    obs, info = envs.reset(seed=1)
    assert isinstance(obs, np.ndarray) and obs.shape == (3, 4) and obs.dtype == np.float32
    obs, reward, terminated, truncated, info = envs.step(np.array([0, 1, 0]))
    assert isinstance(reward, np.ndarray) and terminated.dtype == np.bool_ and truncated.shape == (3,)
    assert envs.num_envs == 3  # other attributes pass through


def test_stand_in_spaces_without_gymnasium(monkeypatch):
    monkeypatch.setattr(spaces, "_gymnasium", lambda: None)
    envs = mg.envs.make("CartPole-v1", num_envs=3, seed=0)
    assert isinstance(envs.single_observation_space, spaces.Box)
    assert envs.single_observation_space.shape == (4,) and envs.single_action_space.n == 2
    assert envs.action_space.shape == (3,) and envs.observation_space.shape == (3, 4)
    obs, _ = envs.reset()
    assert all(envs.single_observation_space.contains(o) for o in obs.numpy())
    assert envs.action_space.contains(envs.action_space.sample())
