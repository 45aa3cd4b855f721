"""PPO's pure pieces: GAE across episode ends, the config's validation."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.rl.config import RLConfig
from multigpu.rl.ppo import ActorCritic, _advantages


def _gae_by_hand(rewards, values, dones, next_value, gamma, lam):
    """Textbook GAE for one environment, written as plainly as possible."""
    steps = len(rewards)
    adv = [0.0] * steps
    running = 0.0
    for t in reversed(range(steps)):
        following = next_value if t == steps - 1 else values[t + 1]
        alive = 0.0 if dones[t] else 1.0
        delta = rewards[t] + gamma * following * alive - values[t]
        running = delta + gamma * lam * alive * running
        adv[t] = running
    return adv


def test_advantages_stop_at_episode_ends_and_bootstrap_the_last_value():
    cfg = RLConfig(num_steps=5, gamma=0.9, gae_lambda=0.8)
    rewards = torch.tensor([[1.0, 0.5], [1.0, 0.5], [1.0, 2.0], [0.0, 1.0], [1.0, 1.0]])
    values = torch.tensor([[0.5, 1.0], [0.4, 0.2], [0.3, 0.1], [0.2, 0.3], [0.1, 0.6]])
    dones = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 1.0]])
    next_value = torch.tensor([0.7, 0.9])
    advantages, returns = _advantages(cfg, rewards, values, dones, next_value)
    for env in range(2):
        expected = _gae_by_hand(rewards[:, env].tolist(), values[:, env].tolist(), dones[:, env].tolist(),
                                float(next_value[env]), 0.9, 0.8)
        assert advantages[:, env].tolist() == pytest.approx(expected)
    assert torch.allclose(returns, advantages + values)


def test_actor_critic_shapes():
    agent = ActorCritic(4, 2, 16)
    logits, value = agent(torch.zeros(7, 4))
    assert logits.shape == (7, 2) and value.shape == (7,)


@pytest.mark.parametrize("change, message", [
    ({"num_envs": 0}, "rl.num_envs must be a whole number >= 1, got 0"),
    ({"gamma": 1.5}, r"rl.gamma must be in \[0, 1\], got 1.5"),
    ({"learning_rate": 0.0}, "rl.learning_rate must be > 0"),
    ({"reward_scale": 0.0}, "rl.reward_scale must be > 0, got 0.0"),
    ({"env_id": "CartPol-v1"}, "rl.env_id: unknown environment 'CartPol-v1'. Did you mean 'CartPole-v1'"),
])
def test_config_rejects_bad_values_by_name(change, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(RLConfig(), **change)
