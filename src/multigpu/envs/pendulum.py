"""Pendulum-v1 as batched tensor code: gymnasium's dynamics, on any device.

Runs inside each rank. Swing a pendulum up and keep it upright with a torque
in [-2, 2]. Dynamics, constants (g = 10), reward
``-(angle^2 + 0.1 * speed^2 + 0.001 * torque^2)``, observation
``(cos theta, sin theta, theta_dot)`` and initial state (angle uniform in
[-pi, pi), speed in [-1, 1)) are gymnasium's ``PendulumEnv``; it never
terminates and is truncated after 200 steps.

    envs = mg.envs.make("Pendulum-v1", num_envs=1024, seed=0)
    obs, r, term, trunc, info = envs.step(torch.zeros(1024, 1))
"""

from __future__ import annotations

import math

import numpy as np
import torch

from multigpu.envs import spaces
from multigpu.envs.vector import VectorEnv, register

__all__ = ["Pendulum"]


class Pendulum(VectorEnv):
    """Inverted pendulum swing-up with a continuous torque (gymnasium's ``Pendulum-v1``)."""

    id = "Pendulum-v1"
    state_dim = 2
    reset_low = (-math.pi, -1.0)  # gymnasium: uniform(low=-high, high=high), high = (pi, 1)
    reset_high = (math.pi, 1.0)
    default_max_episode_steps = 200

    max_speed = 8.0
    max_torque = 2.0
    dt = 0.05
    g = 10.0
    m = 1.0
    l = 1.0  # noqa: E741 - gymnasium's name

    def _make_single_spaces(self):
        high = np.array([1.0, 1.0, self.max_speed], dtype=np.float32)
        return (spaces.box(-high, high, (3,), np.float32),
                spaces.box(-self.max_torque, self.max_torque, (1,), np.float32))

    def _check_actions(self, actions) -> torch.Tensor:
        actions = super()._check_actions(actions)
        return actions.reshape(self.num_envs).to(self.dtype)

    def _dynamics(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        th, thdot = self.rows
        u = actions.clamp(-self.max_torque, self.max_torque)
        angle = torch.remainder(th + math.pi, 2 * math.pi) - math.pi  # gymnasium's angle_normalize
        costs = angle * angle + 0.1 * (thdot * thdot) + 0.001 * (u * u)
        newthdot = thdot + (3 * self.g / (2 * self.l) * torch.sin(th) + 3.0 / (self.m * self.l**2) * u) * self.dt
        newthdot = newthdot.clamp(-self.max_speed, self.max_speed)
        th.add_(newthdot * self.dt)
        thdot.copy_(newthdot)
        reward = (-costs).to(torch.float32)
        terminated = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        return reward, terminated

    def _observe(self) -> torch.Tensor:
        th, thdot = self.rows
        return torch.stack((torch.cos(th), torch.sin(th), thdot), dim=1)


register("Pendulum-v1", Pendulum)
