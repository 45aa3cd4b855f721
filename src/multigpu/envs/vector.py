"""Batched environments with gymnasium 1.x's vector API, and a NumPy adapter (the registry: :mod:`multigpu.envs.registry`).

Runs inside each rank (or in any single process)::

    import multigpu as mg

    envs = mg.envs.make("CartPole-v1", num_envs=4096, device="cpu", seed=0)
    obs, info = envs.reset()
    obs, reward, terminated, truncated, info = envs.step(actions)   # tensors on envs.device

Semantics follow ``gymnasium.vector.VectorEnv`` (1.x):

* ``reset(seed=..., options=...)`` -> ``(obs, info)``; ``step(actions)`` ->
  ``(obs, reward, terminated, truncated, info)``, every value batched along dim 0.
* Autoreset (``autoreset_mode``): ``"next_step"`` (gymnasium's default): the
  step *after* an episode ends resets that environment, returns its first
  observation with reward 0, ``terminated = truncated = False``, and ignores its
  action. ``"same_step"``: an ending step already returns the next episode's
  first observation; the last one is in ``info["final_obs"]`` (mask
  ``info["_final_obs"]``; rows outside the mask equal ``obs``; the keys are
  absent on steps where no episode ended). ``"disabled"``: reset with
  ``reset(options={"reset_mask": mask})`` yourself.
* Time limits: ``truncated`` once an episode reaches ``max_episode_steps``
  (500 for CartPole-v1, 200 for Pendulum-v1), as gymnasium's ``TimeLimit``.
* ``single_observation_space`` / ``single_action_space`` (and the batched
  ``observation_space`` / ``action_space``) are gymnasium spaces when gymnasium
  is installed, else small stand-ins (:mod:`multigpu.envs.spaces`).

``split=True`` makes ``num_envs`` global: this rank builds its share (see
:mod:`multigpu.envs.split`), and every environment's random stream is keyed by
its global id, so trajectories are bit-identical on 1, 2 or 3 ranks.

Glossary: *env id* = an environment's global index in ``[0, num_envs)``;
*episode* = from a reset to ``terminated or truncated``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from multigpu.envs import spaces
from multigpu.envs.split import stream_keys, uniform_bits_np, uniforms
from multigpu.errors import ConfigError

__all__ = ["AUTORESET_MODES", "NumpyVectorEnv", "VectorEnv"]

AUTORESET_MODES = ("next_step", "same_step", "disabled")
# CPU resets up to this many environments use masked copies, above it index arrays: measured
# crossover of whole CartPole steps with either (benchmarks/history/environments.md: masked faster at 4,096, indexed at 8,192)
_MASKED_RESETS_UP_TO = 4096
_GYMNASIUM_MODES = {"NextStep": "next_step", "SameStep": "same_step", "Disabled": "disabled"}  # AutoresetMode values


class VectorEnv:
    """Base of the batched tensor environments: reset, step, autoreset, time limit, random streams.

    A subclass sets ``state_dim`` (rows of ``self.state``, shape ``(state_dim, num_envs)``),
    the box its initial states are drawn from (``reset_low``, ``reset_high``, one
    bound per state row) and ``default_max_episode_steps``, and implements
    ``_dynamics``, ``_observe`` and ``_make_single_spaces``. Everything else
    (gymnasium's vector semantics) lives here.

    Args:
        env_ids: Global ids of the environments this object steps (``range(num_envs)`` alone).
        device: Where the state lives (any torch device).
        seed: Base seed of every environment's reset stream.
        dtype: Float type of the state (float32 default; float64 for reference checks).
        autoreset_mode: One of :data:`AUTORESET_MODES` (or gymnasium's ``AutoresetMode``).
        max_episode_steps: Time limit (truncation); default the environment's own.
    """

    id: str = ""
    state_dim: int = 0
    reset_low: tuple[float, ...] = ()
    reset_high: tuple[float, ...] = ()
    default_max_episode_steps: int = 0

    def __init__(
        self,
        env_ids: Sequence[int] | range,
        *,
        device: str | torch.device = "cpu",
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        autoreset_mode: str = "next_step",
        max_episode_steps: int | None = None,
    ):
        mode_value = getattr(autoreset_mode, "value", autoreset_mode)  # gymnasium's AutoresetMode works too
        autoreset_mode = _GYMNASIUM_MODES.get(mode_value, mode_value)
        if autoreset_mode not in AUTORESET_MODES:
            raise ConfigError(f"autoreset_mode={autoreset_mode!r} is not valid; valid: {', '.join(AUTORESET_MODES)}")
        if dtype not in (torch.float32, torch.float64):
            raise ConfigError(f"dtype={dtype} is not supported; valid: torch.float32, torch.float64")
        self.device = torch.device(device)
        self.dtype = dtype
        self.autoreset_mode = autoreset_mode
        self.max_episode_steps = int(max_episode_steps or self.default_max_episode_steps)
        if self.max_episode_steps < 1:
            raise ConfigError(f"max_episode_steps={max_episode_steps} must be >= 1")
        self.env_ids = torch.as_tensor(list(env_ids), dtype=torch.int64, device=self.device)
        self.num_envs = int(self.env_ids.numel())
        self.metadata = {"autoreset_mode": autoreset_mode}
        self._on_cpu = self.device.type == "cpu"
        self._host = self._on_cpu and self.num_envs <= self.host_step_max_envs
        self._native = None
        """The host step in one compiled call, where a subclass has one (``_host_setup``): it returns the step's
        results, or None for actions it does not take (the NumPy host step then runs)."""
        self.state = self._make_state()
        self.elapsed_steps = torch.zeros(self.num_envs, dtype=torch.int32, device=self.device)
        """Steps into the current episode, per environment."""
        self.rows = self.state.unbind(0)
        """Views of the state's rows (it is only ever updated in place)."""
        self._elapsed_bound = 0  # >= every elapsed step count (CPU): below the limit, nothing can be truncated
        self._resets = torch.zeros(self.num_envs, dtype=torch.int64, device=self.device)
        self._prev_done = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)  # updated in place
        self._spaces: dict[str, Any] = {}
        self._k = self._constants()
        self._one = torch.tensor(1, dtype=torch.int32, device=self.device)
        self._limit = torch.tensor(self.max_episode_steps, dtype=torch.int32, device=self.device)
        low = np.asarray(self.reset_low, dtype=np.float64)
        scale = np.asarray(self.reset_high, dtype=np.float64) - low
        # On the CPU, resets go through NumPy views of the same memory (see _reset_which)
        if self._on_cpu:
            np_dtype = np.float32 if dtype == torch.float32 else np.float64
            self._low, self._scale = low.astype(np_dtype)[:, None], scale.astype(np_dtype)[:, None]
            self._scale_bits = self._scale * np_dtype(2.0**-24)  # draws are bits / 2**24: see uniform_bits_np
            self._views = (self.state.numpy(), self.elapsed_steps.numpy(), self._resets.numpy())
            self._prev_done_np = self._prev_done.numpy()
            self._ahead = np.empty((self.state_dim, self.num_envs), dtype=np_dtype)  # see _draw_ahead
            self._stale = np.ones(self.num_envs, dtype=bool)
            self._scratch_mask = np.empty(self.num_envs, dtype=bool)
            self._row_offsets = np.arange(self.state_dim)[:, None] * self.num_envs
        else:
            self._low = torch.tensor(low, dtype=dtype, device=self.device)[:, None]
            self._scale = torch.tensor(scale, dtype=dtype, device=self.device)[:, None]
        self._seed(seed)
        if self._host:
            self._host_setup()

    # -- subclass hooks --------------------------------------------------------------------------

    def _make_state(self) -> torch.Tensor:
        """The zeroed ``(state_dim, num_envs)`` state tensor (a subclass's host step may lay it inside a larger buffer)."""
        return torch.zeros(self.state_dim, self.num_envs, dtype=self.dtype, device=self.device)

    def _constants(self) -> Any:
        """Constants the dynamics use, made once (available as ``self._k``)."""
        return None

    def _dynamics(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance ``self.state`` by one step in place; return ``(reward, terminated)``."""
        raise NotImplementedError

    def _observe(self) -> torch.Tensor:
        """A fresh ``(num_envs, obs_dim)`` observation tensor (never a view of the state)."""
        raise NotImplementedError

    def _make_single_spaces(self) -> tuple[Any, Any]:
        """``(single_observation_space, single_action_space)``."""
        raise NotImplementedError

    host_step_max_envs: float = 0
    """Up to this many environments, CPU ones step through :meth:`_dynamics_host` and :meth:`_observe_host`
    (see ``_step_host``); above it, through the torch formulation. The same results either way."""

    @property
    def cpu_step(self) -> str:
        """Which formulation steps these environments, for reports: the host step (NumPy views) or torch."""
        if not self._host:
            return "torch step"
        return "host step, masked resets" if self.num_envs <= _MASKED_RESETS_UP_TO else "host step, indexed resets"

    def _host_setup(self) -> None:
        """Make the scratch buffers the host step writes into (once, when ``host_step`` is on)."""

    def _dynamics_host(self, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``_dynamics`` on the CPU, the same bits: return fresh ``(reward, terminated)`` arrays."""
        raise NotImplementedError

    def _observe_host(self) -> torch.Tensor:
        """``_observe`` on the CPU, the same bits and layout."""
        raise NotImplementedError

    # -- spaces --------------------------------------------------------------------------------

    def _space(self, name: str):
        if not self._spaces:
            obs, act = self._make_single_spaces()
            self._spaces = {
                "single_observation_space": obs,
                "single_action_space": act,
                "observation_space": spaces.batch(obs, self.num_envs),
                "action_space": spaces.batch(act, self.num_envs),
            }
        return self._spaces[name]

    @property
    def single_observation_space(self):
        return self._space("single_observation_space")

    @property
    def single_action_space(self):
        return self._space("single_action_space")

    @property
    def observation_space(self):
        return self._space("observation_space")

    @property
    def action_space(self):
        return self._space("action_space")

    # -- the vector API ----------------------------------------------------------------------------

    def _seed(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise ConfigError(
                f"seed={seed!r} must be one int: each environment's stream is keyed by (seed, global env id)"
            )
        self.seed = int(seed)
        self._keys = stream_keys(self.seed, self.env_ids)
        if self._on_cpu:
            self._keys = self._keys.numpy().astype(np.uint32)
            self._stale[:] = True  # new keys: every drawn-ahead state is out of date
        self._resets.zero_()

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[torch.Tensor, dict]:
        """Reset every environment (or those in ``options["reset_mask"]``); return ``(obs, info)``.

        ``seed`` (one int) restarts every environment's stream: reset ``c`` of
        environment ``g`` draws from ``hash(seed, g, c)``, so the same seed gives
        the same initial states whatever the split. Without ``seed`` the
        streams continue.
        """
        if seed is not None:
            self._seed(seed)
        mask = (options or {}).get("reset_mask")
        if mask is None:
            mask = torch.ones(self.num_envs, dtype=torch.bool, device=self.device)
        else:
            mask = torch.as_tensor(mask, dtype=torch.bool, device=self.device)
            if mask.shape != (self.num_envs,):
                raise ConfigError(f"reset_mask has shape {tuple(mask.shape)}; expected ({self.num_envs},)")
        which = self._which(mask)
        if which is not None:
            self._reset_which(which)
        self._prev_done &= ~mask
        return (self._observe_host() if self._host else self._observe()), {}

    def step(self, actions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """Advance every environment by one step; see the module docstring for autoreset."""
        if self._host:
            return self._step_host(actions)
        actions = self._check_actions(actions)
        reward, terminated = self._dynamics(actions)
        self.elapsed_steps.add_(self._one)
        self._elapsed_bound += 1
        if self._on_cpu and self._elapsed_bound < self.max_episode_steps:
            truncated = torch.zeros(self.num_envs, dtype=torch.bool)  # skips a comparison on most steps
        else:
            truncated = self.elapsed_steps >= self._limit
        info: dict[str, Any] = {}
        if self.autoreset_mode == "next_step":
            which = self._which(self._prev_done)
            if which is not None:  # these ended last step: reset now, as gymnasium's next-step autoreset
                self._reset_which(which)
                self._fill(which, (reward, 0.0), (terminated, False), (truncated, False))
            torch.logical_or(terminated, truncated, out=self._prev_done)
            obs = self._observe()
        elif self.autoreset_mode == "same_step":
            done = terminated | truncated
            obs = self._observe()
            which = self._which(done)
            if which is not None:
                info = {"final_obs": obs, "_final_obs": done}
                self._reset_which(which)
                obs = self._observe()
        else:
            obs = self._observe()
        if self._on_cpu and self._elapsed_bound >= self.max_episode_steps:
            self._elapsed_bound = int(self.elapsed_steps.max())  # after this step's resets
        return obs, reward, terminated, truncated, info

    # -- the host step: CPU environments stepped as NumPy views of the same memory -----------------
    #
    # At 64 to a few thousand environments a step is bound by the count of operations, and
    # a NumPy ufunc on preallocated memory costs about a third of a torch eager call. So on
    # the CPU the arithmetic that is exact in IEEE (+, -, *, /, abs, comparisons, clamp,
    # remainder) runs in NumPy, while the operations whose bits belong to torch's kernels
    # stay torch calls on views of the same buffers: sin and cos (SLEEF) and the fused
    # multiply-adds of addcmul and add(alpha=). The result is bit for bit what the torch
    # formulation (``_dynamics``, used on accelerators) gives;
    # tests/unit/test_envs_host_step.py checks that on every path.

    def _host_actions(self, actions) -> np.ndarray:
        """The actions as a NumPy array on the host (a view where they already are), shape-checked."""
        if isinstance(actions, torch.Tensor) and actions.is_cpu and not actions.requires_grad:
            actions = actions.numpy()
        elif not isinstance(actions, np.ndarray):
            actions = self._check_actions(actions).detach().cpu().numpy()
        if actions.shape[:1] != (self.num_envs,):
            self._check_actions(actions)  # raises: says what was expected
        return actions

    def _step_host(self, actions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """:meth:`step` on the CPU, with NumPy bookkeeping: the same results as the torch path."""
        if self._native is not None and (done := self._native(actions)) is not None:
            return done
        reward, terminated = self._dynamics_host(self._host_actions(actions))
        elapsed = self._views[1]
        elapsed += 1
        self._elapsed_bound += 1
        if self._elapsed_bound < self.max_episode_steps:
            truncated = np.zeros(self.num_envs, dtype=bool)  # below the limit: nothing can be truncated
        else:
            truncated = elapsed >= self.max_episode_steps
        info: dict[str, Any] = {}
        if self.autoreset_mode == "next_step":
            prev_done = self._prev_done_np
            if np.count_nonzero(prev_done):  # these ended last step: reset now (gymnasium's next-step autoreset)
                which = self._reset_which(prev_done)
                below_limit = self._elapsed_bound < self.max_episode_steps  # truncated is all False: leave it
                if which is prev_done:  # a mask: masked writes
                    np.copyto(reward, 0.0, where=which)
                    np.greater(terminated, which, out=terminated)  # a > b for bools is a and not b
                    if not below_limit:
                        np.greater(truncated, which, out=truncated)
                else:  # an index array
                    reward[which], terminated[which] = 0.0, False
                    if not below_limit:
                        truncated[which] = False
            np.logical_or(terminated, truncated, out=prev_done)
            obs = self._observe_host()
        elif self.autoreset_mode == "same_step":
            done = terminated | truncated
            obs = self._observe_host()
            if np.count_nonzero(done):
                info = {"final_obs": obs, "_final_obs": torch.from_numpy(done)}
                self._reset_which(done)
                obs = self._observe_host()
        else:
            obs = self._observe_host()
        if self._elapsed_bound >= self.max_episode_steps:
            self._elapsed_bound = int(elapsed.max())  # after this step's resets
        return obs, torch.from_numpy(reward), torch.from_numpy(terminated), torch.from_numpy(truncated), info

    def close(self) -> None:
        """Nothing to release (the state is a tensor); kept for gymnasium compatibility."""

    def state_dict(self) -> dict[str, Any]:
        """Everything the next steps depend on, as tensors: physics state, episode lengths, each
        environment's reset count (its random stream's position), pending next-step resets, the seed."""
        return {"state": self.state.clone(), "elapsed_steps": self.elapsed_steps.clone(),
                "resets": self._resets.clone(), "prev_done": self._prev_done.clone(),
                "seed": self.seed, "env_ids": self.env_ids.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where :meth:`state_dict` was taken (the same environments: ``env_ids`` must match)."""
        if not torch.equal(torch.as_tensor(state["env_ids"]).cpu(), self.env_ids.cpu()):
            raise ConfigError(f"{self.id}: the saved environments are not this rank's (another split or num_envs); "
                              "valid: resume with the same num_envs and world size")
        self._seed(int(state["seed"]))
        # in place: the host step and the reset path hold views of these tensors
        self.state.copy_(state["state"])
        self.elapsed_steps.copy_(state["elapsed_steps"])
        self._resets.copy_(state["resets"])
        self._prev_done.copy_(state["prev_done"])
        if self._on_cpu:
            self._stale[:] = True  # drawn-ahead states are recomputed from the restored reset counts
            self._elapsed_bound = int(self.elapsed_steps.max()) if self.num_envs else 0
        else:
            self._elapsed_bound = int(self.elapsed_steps.max()) if self.num_envs else 0

    def _check_actions(self, actions) -> torch.Tensor:
        actions = torch.as_tensor(actions, device=self.device)
        if actions.shape[:1] != (self.num_envs,):
            raise ConfigError(
                f"{self.id}: step() got actions of shape {tuple(actions.shape)}; expected ({self.num_envs}, ...)"
                " (one action per environment of this rank)"
            )
        return actions

    # -- resets: an index array on the CPU, a mask elsewhere ---------------------------------------
    #
    # On the CPU the few environments that reset in a step are found, drawn and
    # written through NumPy views of the same memory: np.flatnonzero, uint32
    # hashing and fancy indexing cost a fraction of torch's eager nonzero, int64
    # and index_put kernels at these sizes. On accelerators every environment
    # draws and torch.where keeps the masked ones, so no step waits on the host.
    # Both paths draw the same bits (tests/unit/test_envs_vector.py checks the two hashes).

    def _which(self, mask: torch.Tensor):
        """What to reset: the mask (a NumPy view on the CPU, None when it is empty)."""
        if not self._on_cpu:
            return mask
        mask = mask.numpy()
        return mask if np.count_nonzero(mask) else None

    def _fill(self, which, *pairs: tuple[torch.Tensor, Any]) -> None:
        for tensor, value in pairs:
            if self._on_cpu:
                np.copyto(tensor.numpy(), value, where=which)
            else:
                tensor.masked_fill_(which, value)

    def _reset_which(self, which):
        """Reset the environments in ``which`` (a mask); on the CPU return them as a mask or an index array."""
        if not self._on_cpu:
            u = uniforms(self._keys, self._resets, self.state_dim, self.dtype)
            self.state.copy_(torch.where(which, u * self._scale + self._low, self.state))
            self._resets += which
            self.elapsed_steps.masked_fill_(which, 0)
            return
        state, elapsed, resets = self._views  # writes land in the tensors
        stale = self._stale
        if self.num_envs <= _MASKED_RESETS_UP_TO:  # masked copies: no index array to build
            if np.count_nonzero(np.logical_and(stale, which, out=self._scratch_mask)):
                self._draw_ahead()
            np.logical_or(stale, which, out=stale)
            np.copyto(state, self._ahead, where=which)
            np.add(resets, which, out=resets)
            np.copyto(elapsed, 0, where=which)
            return which
        idx = which.nonzero()[0]  # the few that reset, by index: a masked copy would visit every element
        if stale[idx].any():  # the few, not a pass over every environment's flag
            self._draw_ahead()
        stale[idx] = True
        flat = (idx + self._row_offsets).reshape(-1)  # (row, env) -> index into the flat (state_dim * n) state
        state.reshape(-1)[flat] = self._ahead.reshape(-1)[flat]
        resets[idx] += 1
        elapsed[idx] = 0
        return idx

    def _draw_ahead(self) -> None:
        """Draw the next initial state of every environment whose drawn-ahead one is used up (CPU).

        A reset's state is a pure function of (key, reset count), so it can be drawn before
        the reset happens: in one batch for many environments, where drawing at each
        reset would pay the hash's ~30 small NumPy calls for the few that end in a step.
        """
        idx = self._stale.nonzero()[0]
        # uniform(low, high) per row as (bits / 2**24) * scale + low, the 2**-24 folded into the scale (exact)
        drawn = uniform_bits_np(self._keys[idx], self._views[2][idx], self.state_dim).astype(self._low.dtype)
        drawn *= self._scale_bits
        drawn += self._low
        flat = (idx + self._row_offsets).reshape(-1)  # (row, env) -> index into the flat state: 2x a 2-D scatter
        self._ahead.reshape(-1)[flat] = drawn.reshape(-1)
        self._stale[idx] = False

    def __repr__(self) -> str:
        ids = self.env_ids
        span = f"{int(ids[0])}..{int(ids[-1])}" if self.num_envs else "none"
        return (f"{type(self).__name__}(id={self.id!r}, num_envs={self.num_envs}, env_ids={span}, "
                f"device={self.device}, autoreset_mode={self.autoreset_mode!r})")


class NumpyVectorEnv:
    """A thin adapter that takes and returns NumPy arrays, for code written against gymnasium.

    Wraps any :class:`VectorEnv`; observations, rewards and flags come back
    as ``np.ndarray`` (copied to the host), actions may be NumPy arrays or
    lists. Other attributes are the wrapped environment's.

        envs = NumpyVectorEnv(mg.envs.make("CartPole-v1", num_envs=8, seed=0))
        obs, info = envs.reset()                        # np.ndarray (8, 4) float32
        obs, r, term, trunc, info = envs.step(np.zeros(8, dtype=np.int64))
    """

    def __init__(self, env: VectorEnv):
        self.env = env

    def __getattr__(self, name: str):
        return getattr(self.env, name)

    @staticmethod
    def _np(value):
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()
        if isinstance(value, dict):
            return {k: NumpyVectorEnv._np(v) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(NumpyVectorEnv._np(v) for v in value)
        return value

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return self._np(self.env.reset(seed=seed, options=options))

    def step(self, actions):
        return self._np(self.env.step(np.asarray(actions)))

    def close(self) -> None:
        self.env.close()
