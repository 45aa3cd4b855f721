"""CartPole-v1 as batched tensor code: gymnasium's dynamics, on any device.

Runs inside each rank. The physics, constants, thresholds, reward (1 per step,
including the terminating one) and the initial state (each of the four
variables uniform in [-0.05, 0.05)) are gymnasium's ``CartPoleEnv`` with the
Euler integrator; the time limit is 500 steps. ``tests/unit/test_envs_gymnasium_agreement.py``
drives this and gymnasium's own environment from the same states with the
same actions and checks that the transitions agree.

    envs = mg.envs.make("CartPole-v1", num_envs=16_384, seed=0)

The state is stored feature-major, ``(4, num_envs)``, so each variable is a
contiguous row and the update is a handful of in-place vector operations.
On the CPU the same operations run as ``_dynamics_host``: NumPy on views of
the state for the exact arithmetic, torch for sin, cos and the fused
multiply-adds, with the same bits (``tests/unit/test_envs_host_step.py``);
elsewhere ``_dynamics`` runs as torch code. In float32 with next-step autoreset
(the default) and int or bool actions, a whole CPU step is torch's sin and cos
then one C loop (:func:`multigpu.sim.native.cartpole_step`: dynamics,
termination, time limit, resets drawn from the same hash, observation), the
same bits again, where the C kernels build.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch

from multigpu.envs import spaces
from multigpu.envs.registry import register
from multigpu.envs.vector import VectorEnv

__all__ = ["CartPole"]

# up to this many environments, int64 actions take their force from a 2-entry table in one call
# (3 calls otherwise); above it the three streaming passes are faster (measured crossover 8-16k)
_TAKE_FORCE_UP_TO = 8192


class CartPole(VectorEnv):
    """A pole on a cart; action 0 pushes left, 1 pushes right (gymnasium's ``CartPole-v1``)."""

    id = "CartPole-v1"
    state_dim = 4
    reset_low = (-0.05,) * 4  # gymnasium: uniform(low=-0.05, high=0.05) for each variable
    reset_high = (0.05,) * 4
    default_max_episode_steps = 500

    gravity = 9.8
    masscart = 1.0
    masspole = 0.1
    total_mass = masspole + masscart
    length = 0.5  # half the pole's length
    polemass_length = masspole * length
    force_mag = 10.0
    tau = 0.02  # seconds between state updates
    theta_threshold_radians = 12 * 2 * math.pi / 360
    x_threshold = 2.4

    def _make_single_spaces(self):
        high = np.array([self.x_threshold * 2, np.inf, self.theta_threshold_radians * 2, np.inf], dtype=np.float32)
        return spaces.box(-high, high, (4,), np.float32), spaces.discrete(2)

    def _constants(self) -> SimpleNamespace:
        # 0-dim tensors in the state's dtype: a Python float operand costs a conversion per call
        def c(value: float) -> torch.Tensor:
            return torch.tensor(value, dtype=self.dtype, device=self.device)

        return SimpleNamespace(
            two_force=c(2 * self.force_mag), force=c(self.force_mag), gravity=c(self.gravity),
            inv_total_mass=c(1.0 / self.total_mass), den0=c(self.length * 4.0 / 3.0),
            thresholds=torch.tensor([[self.x_threshold], [self.theta_threshold_radians]], dtype=self.dtype,
                                    device=self.device),
        )

    def _dynamics(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._k
        x, x_dot, theta, theta_dot = self.rows  # views: updated in place below
        # gymnasium: force = sign(action - 0.5) * force_mag; clamp(0, 1) gives the same for any integer
        force = actions.to(self.dtype).clamp_(0, 1).mul_(k.two_force).sub_(k.force)
        costheta = torch.cos(theta)
        sintheta = torch.sin(theta)
        # temp = (force + m_p l theta_dot^2 sin) / M
        temp = torch.addcmul(force, theta_dot * theta_dot, sintheta, value=self.polemass_length).mul_(k.inv_total_mass)
        # thetaacc = (g sin - cos temp) / (l (4/3 - m_p cos^2 / M))
        denom = torch.addcmul(k.den0, costheta, costheta, value=-self.length * self.masspole / self.total_mass)
        thetaacc = torch.addcmul(sintheta * k.gravity, costheta, temp, value=-1.0).div_(denom)
        xacc = torch.addcmul(temp, thetaacc, costheta, value=-self.polemass_length / self.total_mass)
        # Euler, in gymnasium's order: positions move with the old velocities
        x.add_(x_dot, alpha=self.tau)
        x_dot.add_(xacc, alpha=self.tau)
        theta.add_(theta_dot, alpha=self.tau)
        theta_dot.add_(thetaacc, alpha=self.tau)
        # |x| > 2.4 or |theta| > 12 degrees, as max(|x| - 2.4, |theta| - 12deg) > 0 through clamp and
        # bool(): exact for floats, and a third of the time of two bool comparisons on the CPU
        over = self.state[0::2].abs().sub_(k.thresholds)  # rows x and theta
        terminated = torch.maximum(over[0], over[1]).clamp_(min=0).bool()
        reward = torch.ones(self.num_envs, dtype=torch.float32, device=self.device)
        return reward, terminated

    def _observe(self) -> torch.Tensor:
        # (num_envs, 4) in column-major memory, as gymnasium's own `state.T.astype(float32)`:
        # a plain copy, where a row-major transpose costs ~25x more on the CPU
        return self.state.T.clone()

    # -- the host step (CPU): _dynamics's operations, the exact ones in NumPy -------------------------

    host_step_max_envs = math.inf  # measured faster than the torch formulation at 64 to 65,536 (benchmarks/history/environments.md)

    def _make_state(self) -> torch.Tensor:
        if not self._host:
            return super()._make_state()
        # the state is rows 4-7 of an (8, num_envs) buffer whose even rows (0 force, 2 den0, 4 x, 6 theta) and
        # odd rows (1, 3, 5 x_dot, 7 theta_dot) are two evenly strided (4, num_envs) views: one addcmul
        # does temp and denom and, with tau as its third operand, the positions' Euler step (see _dynamics_host)
        self._host_rows = torch.zeros(8, self.num_envs, dtype=self.dtype)
        return self._host_rows[4:]

    def _host_setup(self) -> None:
        # scratch rows: 0 sin, 1 cos, 2-3 tau | 4 temp | 5 g*sin | 6 v*thetaacc | 7 xacc, 8 thetaacc | 9-10 |x|, |theta|
        t = torch.empty(11, self.num_envs, dtype=self.dtype)
        t[2:4] = self.tau  # as _dynamics's add_(alpha=tau), rounded to the state's dtype
        self._den0 = np.array(self.length * 4.0 / 3.0, dtype=t.numpy().dtype)  # den0, as _constants rounds it
        rows = self._host_rows
        n, r = t.numpy(), rows.numpy()
        self._ht = (rows[0::2], rows[1::2], t[0:4], t[0], t[1], rows[0], t[8], t[5], t[6], t[7], t[7:9],
                    self.state[2], self.state[1::2])
        self._hn = (r[0], r[1], r[2], r[3], n[0], n[1], n[5], n[6], n[8], n[9:11], r[7], r[4::2])
        self._hb = np.empty((2, self.num_envs), dtype=bool)
        self._ones = np.ones(self.num_envs, dtype=np.float32)  # reward: 1 per step

        def c(value):  # the Python constants _dynamics hands torch, rounded to the state's dtype as torch does
            return np.array(value, dtype=n.dtype)

        self._hk = (c(self.polemass_length), c(-self.length * self.masspole / self.total_mass),
                    c(1.0 / self.total_mass), c(self.gravity), c(-self.polemass_length / self.total_mass),
                    c(2 * self.force_mag), c(self.force_mag), c(0), c(1),
                    np.array([[self.x_threshold], [self.theta_threshold_radians]], dtype=n.dtype))
        self._force_table = np.array([0, 1], dtype=n.dtype) * self._hk[5] - self._hk[6]  # 20 a - 10 for a = 0, 1
        if self.dtype == torch.float32 and self.autoreset_mode == "next_step" and self.num_envs:
            self._native = self._first_native_step  # set up on the first step: a config check builds envs too

    def _first_native_step(self, actions) -> tuple | None:
        self._native = None
        self._native_setup()
        return self._native(actions) if self._native is not None else None

    def _native_setup(self) -> None:
        """The whole step as one C loop (float32, next-step autoreset, where the C kernels build): torch's sin and
        cos of theta, then :func:`multigpu.sim.native.cartpole_step` (the same bits: tests/unit/test_envs_host_step.py)."""
        from multigpu.sim import native

        step = native.cartpole_step()
        if step is None:
            return
        n = self.num_envs
        self._sc = torch.empty(2, n, dtype=torch.float32)  # sin, cos of theta
        self._theta = self.state[2]
        # the buffers the C step reads and writes, by address: 2 actions, 7 keys (a reseed replaces them), 8-11 outputs,
        # 12 scratch (the force of each action)
        self._force = np.empty(n, dtype=np.float32)
        self._ptrs = np.zeros(13, dtype=np.int64)
        self._ptrs[12] = self._force.ctypes.data
        self._ptrs[[0, 1, 3, 4, 5]] = [self.state.data_ptr(), self._sc.data_ptr(), self.elapsed_steps.data_ptr(),
                                       self._resets.data_ptr(), self._prev_done.data_ptr()]
        self._ptrs[6] = self._stale.ctypes.data
        k = np.array([self.polemass_length, -self.length * self.masspole / self.total_mass, 1.0 / self.total_mass,
                      self.gravity, -self.polemass_length / self.total_mass, 2 * self.force_mag, self.force_mag,
                      self.length * 4.0 / 3.0, self.tau, self.x_threshold, self.theta_threshold_radians,
                      *self._low[:, 0], *self._scale_bits[:, 0]], dtype=np.float64).astype(np.float32)
        self._k32 = k  # rounded to float32 as torch rounds a Python scalar for a float32 op
        self._native_call = (step, self._ptrs.ctypes.data, k.ctypes.data)
        self._native = self._step_native

    def _step_native(self, actions) -> tuple | None:
        """:meth:`VectorEnv.step` for int, bool or uint8 actions in one C call; None for others (NumPy path)."""
        actions = self._host_actions(actions)
        if actions.ndim != 1 or actions.dtype.kind not in "biu" or actions.itemsize not in (1, 4, 8) \
                or (actions.dtype.kind == "u" and actions.itemsize != 1) or not actions.flags.c_contiguous:
            return None
        n = self.num_envs
        torch.sin(self._theta, out=self._sc[0])
        torch.cos(self._theta, out=self._sc[1])
        obs = torch.empty(4, n, dtype=torch.float32)
        reward = torch.empty(n, dtype=torch.float32)
        terminated = torch.empty(n, dtype=torch.bool)
        truncated = torch.empty(n, dtype=torch.bool)
        ptrs = self._ptrs
        ptrs[2] = actions.ctypes.data
        ptrs[7] = self._keys.ctypes.data
        ptrs[8], ptrs[9], ptrs[10], ptrs[11] = obs.data_ptr(), reward.data_ptr(), terminated.data_ptr(), \
            truncated.data_ptr()
        step, p, k = self._native_call
        self._elapsed_bound = step(p, n, actions.itemsize, self.max_episode_steps, k)
        return obs.T, reward, terminated, truncated, {}

    def _dynamics_host(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        (even_t, odd_t, third_t, sin_t, cos_t, temp_t, thetaacc_t, gsin_t, vth_t, xacc_t, acc_t, theta_t,
         vel_t) = self._ht
        force, pml_thd2, den0, c_cos, sin, cos, gsin, vth, thetaacc, absxt, theta_dot, xt = self._hn
        pml, den, inv_total_mass, gravity, xacc_c, two_force, force_mag, zero, one, thresholds = self._hk
        hb = self._hb
        if actions.dtype == np.intp and self.num_envs <= _TAKE_FORCE_UP_TO:
            # force = 20 clamp(a, 0, 1) - 10 is -10 or 10: a table lookup whose index clip is the clamp (one call)
            np.take(self._force_table, actions, mode="clip", out=force)
        else:
            if actions.dtype.kind in "biu":  # clamp(0, 1) of a whole number is (a > 0): force = 20 (a > 0) - 10
                np.greater(actions, 0, out=hb[0])
                np.multiply(hb[0], two_force, out=force)
            else:  # as _dynamics: actions.to(dtype).clamp_(0, 1).mul_(2 force)
                np.copyto(force, actions, casting="unsafe")
                np.maximum(force, zero, out=force)
                np.minimum(force, one, out=force)
                np.multiply(force, two_force, out=force)
            np.subtract(force, force_mag, out=force)
        np.copyto(den0, self._den0)  # the last step's addcmul wrote denom over it
        torch.cos(theta_t, out=cos_t)
        torch.sin(theta_t, out=sin_t)
        # addcmul(self, t1, t2, value=v) is fma(v * t1, t2, self): v * t1 is formed here, and one in-place call
        # does temp = addcmul(force, theta_dot^2, sin, pml), denom = addcmul(den0, cos, cos, den) and, with the
        # old velocities and tau, Euler's (x, theta) += tau (x_dot, theta_dot): add_(alpha=tau) is fma(v, tau, x)
        np.multiply(theta_dot, theta_dot, out=pml_thd2)
        np.multiply(pml_thd2, pml, out=pml_thd2)
        np.multiply(cos, den, out=c_cos)
        even_t.addcmul_(odd_t, third_t)
        temp = force  # rows 0 and 2 now hold temp and denom
        np.multiply(temp, inv_total_mass, out=temp)
        np.multiply(sin, gravity, out=gsin)
        torch.addcmul(gsin_t, cos_t, temp_t, value=-1.0, out=thetaacc_t)
        np.divide(thetaacc, den0, out=thetaacc)
        np.multiply(thetaacc, xacc_c, out=vth)
        torch.addcmul(temp_t, vth_t, cos_t, out=xacc_t)
        # Euler's (x_dot, theta_dot) += tau (xacc, thetaacc), in one call
        vel_t.add_(acc_t, alpha=self.tau)
        # terminated = not (|x| <= 2.4 and |theta| <= 12 deg): _dynamics's max(|x| - 2.4, ...) > 0, NaN included
        np.abs(xt, out=absxt)
        np.less_equal(absxt, thresholds, out=hb)
        terminated = np.logical_and(hb[0], hb[1])
        np.logical_not(terminated, out=terminated)
        return self._ones.copy(), terminated

    def _observe_host(self) -> torch.Tensor:
        return torch.from_numpy(self._views[0].T.copy(order="K"))


register("CartPole-v1", CartPole)
