"""PPO's networks and action distributions: a categorical head for Discrete spaces, a Gaussian one for Box.

Runs inside each rank (``policy_for`` also in the launcher, to reject a space before anything starts).
Both networks return ``(out, value)``: the logits, or the Gaussian's mean and log-std side by side,
so DDP sees every parameter in the forward pass and the PPO loop is the same for both; a
:class:`Head` turns ``out`` into samples, log-probabilities and entropies.

The Gaussian's log-std is one learned vector (state-independent, CleanRL's ``ppo_continuous_action``).
On every dimension with finite bounds the policy acts in ``[-1, 1]``, mapped affinely onto
``[low, high]`` (SB3's advice to normalise the action space): ``action_bounds="clip"`` clamps the
sample to ``[-1, 1]`` first, ``"tanh"`` squashes it. The log-probability is the unsquashed
sample's: the squash is a fixed map applied on the way to the environment, so PPO's ratio is the
same either way. ``"clip"`` passes unbounded dimensions through unchanged; ``"tanh"`` needs bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from multigpu.errors import ConfigError

__all__ = ["ActionMap", "ActorCritic", "Categorical", "DiagGaussian", "GaussianActorCritic", "Head", "PolicySpec",
           "policy_for"]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def _layer(n_in: int, n_out: int, gain: float = 2**0.5) -> nn.Linear:
    layer = nn.Linear(n_in, n_out)
    nn.init.orthogonal_(layer.weight, gain)
    nn.init.zeros_(layer.bias)
    return layer


def _mlp(n_in: int, hidden: int, n_out: int, gain: float) -> nn.Sequential:
    return nn.Sequential(_layer(n_in, hidden), nn.Tanh(), _layer(hidden, hidden), nn.Tanh(), _layer(hidden, n_out, gain))


class ActorCritic(nn.Module):
    """Separate tanh MLPs for the policy's logits and the state value (CleanRL's initialisation)."""

    def __init__(self, obs_dim: int, num_actions: int, hidden: int):
        super().__init__()
        self.actor = _mlp(obs_dim, hidden, num_actions, 0.01)
        self.critic = _mlp(obs_dim, hidden, 1, 1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs).squeeze(-1)


class GaussianActorCritic(nn.Module):
    """A tanh MLP for the Gaussian's mean, a learned state-independent log-std, and a value MLP.

    ``forward`` returns ``(cat(mean, log_std), value)``: shape ``(batch, 2 * action_dim)`` and ``(batch,)``.
    """

    def __init__(self, obs_dim: int, action_dim: int, hidden: int, log_std_init: float = 0.0):
        super().__init__()
        self.actor_mean = _mlp(obs_dim, hidden, action_dim, 0.01)
        self.log_std = nn.Parameter(torch.full((action_dim,), float(log_std_init)))
        self.critic = _mlp(obs_dim, hidden, 1, 1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean = self.actor_mean(obs)
        return torch.cat((mean, self.log_std.expand_as(mean)), -1), self.critic(obs).squeeze(-1)


class Head:
    """An action distribution over a network's ``out``: ``sample``, ``log_prob``, ``entropy`` (one value per row)."""

    def sample(self, out: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def log_prob(self, out: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def entropy(self, out: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Categorical(Head):
    """``torch.distributions.Categorical(logits=out)``, sampled with an explicit generator."""

    def sample(self, out, generator):
        return torch.multinomial(torch.softmax(out, -1), 1, generator=generator).squeeze(1)

    def log_prob(self, out, action):
        return torch.log_softmax(out, -1).gather(1, action[:, None]).squeeze(1)

    def entropy(self, out):
        logp = torch.log_softmax(out, -1)
        return -(logp.exp() * logp).sum(-1)


class DiagGaussian(Head):
    """``Independent(Normal(mean, exp(log_std)), 1)`` with ``out = cat(mean, log_std)``."""

    def sample(self, out, generator):
        mean, log_std = out.chunk(2, -1)
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
        return mean + log_std.exp() * noise

    def log_prob(self, out, action):
        mean, log_std = out.chunk(2, -1)
        z = (action - mean) * torch.exp(-log_std)
        return (-0.5 * z * z - log_std - _LOG_SQRT_2PI).sum(-1)

    def entropy(self, out):
        log_std = out.chunk(2, -1)[1]
        return (0.5 + _LOG_SQRT_2PI + log_std).sum(-1)


class ActionMap:
    """The policy's action -> the environment's: a Discrete space's offset (``start``); for a Box, the map in
    the module docstring, then the space's shape."""

    def __init__(self, *, start: int = 0, low: np.ndarray | None = None, high: np.ndarray | None = None,
                 shape: tuple[int, ...] = (), bounds: str = "clip", device: torch.device | str = "cpu"):
        self.start, self.shape, self.bounds = start, tuple(shape), bounds
        self.box = low is not None
        if self.box:
            low_np, high_np = (np.asarray(b, dtype=np.float64).reshape(-1) for b in (low, high))
            low_t = torch.as_tensor(low_np, dtype=torch.float32, device=device)
            high_t = torch.as_tensor(high_np, dtype=torch.float32, device=device)
            self.finite = torch.isfinite(low_t) & torch.isfinite(high_t)
            # from the host's copy of the bounds: asking the device tensor would wait for the GPU
            with np.errstate(over="ignore"):  # a bound beyond float32's range is inf there, as in the tensors
                self.all_finite = bool(np.isfinite(low_np.astype(np.float32)).all() and
                                       np.isfinite(high_np.astype(np.float32)).all())
            self.center = torch.where(self.finite, (high_t + low_t) / 2, torch.zeros_like(low_t))
            self.half = torch.where(self.finite, (high_t - low_t) / 2, torch.ones_like(low_t))

    def __call__(self, action: torch.Tensor) -> torch.Tensor:
        if not self.box:
            return action + self.start if self.start else action
        unit = torch.tanh(action) if self.bounds == "tanh" else action.clamp(-1.0, 1.0)
        if not self.all_finite:
            unit = torch.where(self.finite, unit, action)
        return (self.center + self.half * unit).reshape(action.shape[0], *self.shape)


@dataclass(frozen=True)
class PolicySpec:
    """What PPO builds for a pair of spaces."""

    obs_dim: int
    discrete: bool
    action_dim: int
    """Actions for a Discrete space (the logits' width), else the Box's flattened size."""
    action_map: Any
    """Arguments of :class:`ActionMap` (made on the rank's device by :meth:`make_map`)."""

    def make_head(self) -> Head:
        return Categorical() if self.discrete else DiagGaussian()

    def make_network(self, hidden: int, log_std_init: float = 0.0) -> nn.Module:
        if self.discrete:
            return ActorCritic(self.obs_dim, self.action_dim, hidden)
        return GaussianActorCritic(self.obs_dim, self.action_dim, hidden, log_std_init)

    def make_map(self, device) -> ActionMap:
        return ActionMap(**self.action_map, device=device)


def _describe(space: Any) -> str:
    text = repr(space)
    return text if len(text) <= 80 else text[:77] + "..."


def policy_for(obs_space: Any, action_space: Any, *, action_bounds: str = "clip", what: str = "the environment"
               ) -> PolicySpec:
    """The networks and action map for these spaces; ConfigError (one line) for anything PPO cannot act in.

    Observations: a Box (or any space with a shape; flattened). Actions: a Discrete or a Box
    (``action_bounds="tanh"`` needs finite bounds on every dimension).
    """
    obs_shape = getattr(obs_space, "shape", None)
    if obs_shape is None or hasattr(obs_space, "n") or hasattr(obs_space, "nvec"):
        raise ConfigError(f"{what} has observation space {_describe(obs_space)}; valid: a Box (an array of floats)")
    obs_dim = int(np.prod(obs_shape)) if obs_shape else 1
    if hasattr(action_space, "n") and getattr(action_space, "shape", ()) in ((), None):
        return PolicySpec(obs_dim, True, int(action_space.n), {"start": int(getattr(action_space, "start", 0))})
    low, high = getattr(action_space, "low", None), getattr(action_space, "high", None)
    shape = getattr(action_space, "shape", None)
    if low is None or high is None or shape is None or hasattr(action_space, "nvec"):
        raise ConfigError(f"{what} has action space {_describe(action_space)}; valid: Discrete or Box")
    low, high = np.broadcast_to(low, shape), np.broadcast_to(high, shape)
    if action_bounds == "tanh" and not (np.isfinite(low).all() and np.isfinite(high).all()):
        raise ConfigError(f"{what} has an action space without finite bounds ({_describe(action_space)}); "
                          "action_bounds=tanh squashes into [low, high]: give the Box bounds, or use action_bounds=clip")
    if np.any(low > high):
        raise ConfigError(f"{what} has an action space with low > high ({_describe(action_space)})")
    return PolicySpec(obs_dim, False, int(np.prod(shape)) if shape else 1,
                      {"low": low, "high": high, "shape": tuple(shape), "bounds": action_bounds})
