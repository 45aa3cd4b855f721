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
from multigpu.envs.registry import register
from multigpu.envs.vector import VectorEnv

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

    # -- the host step (CPU): _dynamics's operations in NumPy, sin and cos in torch ------------------------

    # measured crossover: NumPy's remainder and the extra passes lose to torch above ~8k (benchmarks/history/environments.md)
    host_step_max_envs = 8192

    def _host_setup(self) -> None:
        # scratch rows: 0 u, 1 sin(theta), 2 angle then the cost, 3 a product, 4 new theta_dot | 5-7 the observation
        t = torch.empty(8, self.num_envs, dtype=self.dtype)
        self._ht = (t[1], t[5], t[6], self.state[0])
        self._hn = tuple(t.numpy()[:5]) + (t.numpy()[5:8],)

        def c(value):  # the Python constants _dynamics hands torch, rounded to the state's dtype as torch does
            return np.array(value, dtype=self._hn[0].dtype)

        self._hk = (c(math.pi), c(2 * math.pi), c(0.1), c(0.001), c(3 * self.g / (2 * self.l)),
                    c(3.0 / (self.m * self.l**2)), c(self.dt), c(self.max_speed), c(-self.max_speed),
                    c(self.max_torque), c(-self.max_torque))

    def _dynamics_host(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sin_t, _, _, th_t = self._ht
        u, sin, cost, product, new_thdot, _ = self._hn
        pi, two_pi, c_speed, c_torque, c_gravity, c_inertia, dt, max_speed, min_speed, max_torque, min_torque = self._hk
        th, thdot = self._views[0]
        if actions.size != self.num_envs:
            self._check_actions(torch.as_tensor(actions))  # raises what the torch path raises
        np.copyto(u, actions.reshape(self.num_envs), casting="unsafe")  # actions.reshape(n).to(dtype)
        np.maximum(u, min_torque, out=u)  # clamp(-2, 2)
        np.minimum(u, max_torque, out=u)
        torch.sin(th_t, out=sin_t)
        # costs = angle^2 + 0.1 theta_dot^2 + 0.001 u^2, angle = remainder(theta + pi, 2 pi) - pi
        np.add(th, pi, out=cost)
        np.remainder(cost, two_pi, out=cost)
        np.subtract(cost, pi, out=cost)
        np.multiply(cost, cost, out=cost)
        np.multiply(thdot, thdot, out=product)
        np.multiply(product, c_speed, out=product)
        np.add(cost, product, out=cost)
        np.multiply(u, u, out=product)
        np.multiply(product, c_torque, out=product)
        np.add(cost, product, out=cost)
        # new theta_dot = clamp(theta_dot + (15 sin(theta) + 3 u) dt, -8, 8); theta += new theta_dot dt
        np.multiply(sin, c_gravity, out=new_thdot)
        np.multiply(u, c_inertia, out=product)
        np.add(new_thdot, product, out=new_thdot)
        np.multiply(new_thdot, dt, out=new_thdot)
        np.add(thdot, new_thdot, out=new_thdot)
        np.maximum(new_thdot, min_speed, out=new_thdot)
        np.minimum(new_thdot, max_speed, out=new_thdot)
        np.multiply(new_thdot, dt, out=product)
        np.add(th, product, out=th)
        np.copyto(thdot, new_thdot)
        reward = np.negative(cost, dtype=np.float32) if cost.dtype == np.float32 else np.negative(cost).astype(
            np.float32)
        return reward, np.zeros(self.num_envs, dtype=bool)

    def _observe_host(self) -> torch.Tensor:
        _, cos_t, sin_t, th_t = self._ht
        obs = self._hn[5]  # rows cos, sin, theta_dot; returned as a (num_envs, 3) row-major copy
        torch.cos(th_t, out=cos_t)
        torch.sin(th_t, out=sin_t)
        np.copyto(obs[2], self._views[0][1])
        return torch.from_numpy(obs.T.copy())


register("Pendulum-v1", Pendulum)
