"""Your own batched environment: how its factory is called, and an adapter that hands back tensors.

Runs inside each rank (and once in the launcher, where ``multigpu rl --env`` reads the spaces).
An environment factory is any callable that returns an object with gymnasium 1.x's
vector API - ``reset``, ``step``, ``num_envs``, ``single_observation_space``,
``single_action_space``, ``metadata["autoreset_mode"]`` - stepping NumPy arrays or
torch tensors. :func:`build` calls it with the keyword arguments it names among

==================  ==========================================================================
``num_envs``        how many environments this call builds (a rank's share when split)
``env_ids``         their global ids, a ``range``: key random streams by them to be split-independent
``seed``            the base seed; a factory that does not take ``env_ids`` gets
                    ``seed + env_ids.start``, and so does each ``reset(seed=s)``: gymnasium seeds
                    sub-environment ``i`` with ``s + i``, so every environment is seeded by its
                    global id whatever the split
``device``          the rank's device (``torch.device``)
``autoreset_mode``  the mode the caller wants: "next_step", "same_step" or "disabled"
``max_episode_steps``, ``dtype``   when the caller gives them
==================  ==========================================================================

plus its own ``kwargs`` (a factory with ``**kwargs`` gets ``num_envs``, ``seed`` and ``device``).
Anything it returns that is not a :class:`~multigpu.envs.VectorEnv` is wrapped in
:class:`TorchVectorEnv`, so the caller always sees tensors::

    def make_env(num_envs, seed, device):                      # pkg/envs.py
        return gymnasium.make_vec("Pendulum-v1", num_envs, vectorization_mode="sync")

    envs = mg.envs.make("pkg.envs:make_env", num_envs=64, seed=0, split=True)   # tensors on mg.device()
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from multigpu.errors import ConfigError

__all__ = ["FACTORY_ARGUMENTS", "TorchVectorEnv", "autoreset_mode_of", "build"]

_MODES = {"NextStep": "next_step", "SameStep": "same_step", "Disabled": "disabled"}  # gymnasium's AutoresetMode values


def autoreset_mode_of(env: Any) -> str:
    """``"next_step"``, ``"same_step"`` or ``"disabled"``: the env's own, as gymnasium 1.x records it in
    ``metadata["autoreset_mode"]`` (gymnasium's default, next_step, when it says nothing)."""
    mode = getattr(env, "autoreset_mode", None) or (getattr(env, "metadata", None) or {}).get("autoreset_mode")
    mode = getattr(mode, "value", mode) or "NextStep"
    return _MODES.get(mode, mode)


FACTORY_ARGUMENTS = ("num_envs", "env_ids", "seed", "device", "autoreset_mode", "max_episode_steps", "dtype")
"""What :func:`build` passes an environment factory that names them (so a factory may require them)."""


def _names(factory: Callable) -> tuple[set[str], bool]:
    """The keyword names ``factory`` takes and whether it has ``**kwargs``."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return set(), True
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def build(factory: Callable, env_ids: range, *, seed: int, device: torch.device | str, what: str = "env factory",
          kwargs: Mapping[str, Any] | None = None, **extra: Any) -> Any:
    """Call an environment factory with the arguments it names (module docstring); wrap what it returns.

    ``extra``: ``autoreset_mode``, ``max_episode_steps``, ``dtype`` (None values are not passed).
    Raises ConfigError when the factory takes neither ``num_envs`` nor ``env_ids`` (nor ``**kwargs``), or fails.
    """
    from multigpu.envs.vector import VectorEnv

    names, var_kw = _names(factory)
    kwargs = dict(kwargs or {})
    if not ({"num_envs", "env_ids"} & names or var_kw or {"num_envs", "env_ids"} & set(kwargs)):
        raise ConfigError(f"{what} {getattr(factory, '__name__', factory)!r} takes neither num_envs nor env_ids; "
                          "an environment factory is called with num_envs (this rank's share), seed and device")
    offset = 0 if "env_ids" in names else env_ids.start  # gymnasium's convention: sub-environment i gets seed + i
    context = {"num_envs": len(env_ids), "env_ids": env_ids, "seed": seed + offset, "device": torch.device(device),
               **{k: v for k, v in extra.items() if v is not None}}
    always = ("num_envs", "seed", "device") if var_kw else ()
    args = {k: v for k, v in context.items() if (k in names or k in always) and k not in kwargs}
    try:
        env = factory(**args, **kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's factory can fail in any way
        raise ConfigError(f"{what}: calling {getattr(factory, '__name__', 'it')}() failed: "
                          f"{type(exc).__name__}: {exc}") from None
    for attr in ("reset", "step", "num_envs", "single_observation_space", "single_action_space"):
        if not hasattr(env, attr):
            raise ConfigError(f"{what} returned {type(env).__name__}, which has no {attr!r}; an environment "
                              "factory returns a batched environment with gymnasium 1.x's vector API")
    if int(getattr(env, "num_envs", -1)) != len(env_ids):
        raise ConfigError(f"{what} returned {getattr(env, 'num_envs', 'no num_envs')!r} environments; "
                          f"it was asked for num_envs={len(env_ids)}")
    if isinstance(env, VectorEnv):
        return env
    return TorchVectorEnv(env, device, seed_offset=offset, autoreset_mode=extra.get("autoreset_mode"))


class TorchVectorEnv:
    """Any gymnasium 1.x vector environment - NumPy arrays or tensors - as tensors on ``device``.

    Observations, rewards and flags come back as tensors on ``device`` (dtypes kept; NumPy
    float64 stays float64); actions are handed to a NumPy environment as arrays, to a torch one as
    tensors on its own device. ``info["final_obs"]`` (gymnasium's object array with None where no
    episode ended) becomes one tensor whose other rows equal ``obs``. ``reset(seed=s)`` seeds the
    environment with ``s + seed_offset`` (see :func:`build`). Asked for ``autoreset_mode="same_step"``,
    an environment with autoreset disabled gets it here: the environments that ended are reset
    with ``options={"reset_mask": ...}`` and their last observation goes to ``info["final_obs"]``.
    Other attributes are the wrapped environment's.

        envs = TorchVectorEnv(gymnasium.make_vec("CartPole-v1", 8), "cpu")
        obs, info = envs.reset(seed=0)                  # torch.float32 (8, 4)
    """

    def __init__(self, env: Any, device: torch.device | str = "cpu", *, seed_offset: int = 0,
                 autoreset_mode: str | None = None):
        self.env = env
        self.device = torch.device(device)
        self.seed_offset = seed_offset
        self.num_envs = int(env.num_envs)
        own = autoreset_mode_of(env)
        self._emulate = autoreset_mode == "same_step" and own == "disabled"
        self.autoreset_mode = "same_step" if self._emulate else own
        self.metadata = {**(getattr(env, "metadata", None) or {}), "autoreset_mode": self.autoreset_mode}
        self._numpy: bool | None = None  # does the env step NumPy arrays? (known after the first reset)
        self._env_device: torch.device | None = None

    def __getattr__(self, name: str):
        return getattr(self.env, name)

    def _tensor(self, value: Any, like: torch.Tensor | None = None) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(self.device)
        if isinstance(value, np.ndarray):
            if value.dtype == object:  # gymnasium's final_obs: one entry per env, None where none ended
                return self._stack(value, like)
            return torch.from_numpy(np.ascontiguousarray(value)).to(self.device)
        if isinstance(value, (bool, int, float, np.number, np.bool_)):
            return torch.as_tensor(value, device=self.device)
        if isinstance(value, Mapping):
            return {k: self._tensor(v, like) for k, v in value.items()}
        return value

    def _stack(self, entries: np.ndarray, like: torch.Tensor | None) -> Any:
        rows = [None if e is None else torch.as_tensor(np.asarray(e)) for e in entries]
        if like is None or any(r is not None and tuple(r.shape) != tuple(like.shape[1:]) for r in rows):
            return entries
        out = like.clone()
        for i, row in enumerate(rows):
            if row is not None:
                out[i] = row.to(self.device, out.dtype)
        return out

    def _seen(self, obs: Any) -> None:
        if self._numpy is None:
            self._numpy = not isinstance(obs, torch.Tensor)
            self._env_device = None if self._numpy else obs.device

    def _to_env(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if self._numpy:
            return value.detach().cpu().numpy()
        return value.to(self._env_device)

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[torch.Tensor, dict]:
        if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
            seed = int(seed) + self.seed_offset
        if options and "reset_mask" in options and self._numpy is not None:
            options = {**options, "reset_mask": self._to_env(torch.as_tensor(options["reset_mask"]).bool())}
        obs, info = self.env.reset(seed=seed, options=options)
        self._seen(obs)
        obs = self._tensor(obs)
        return obs, self._tensor(info, obs)

    def step(self, actions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        if self._numpy is None:
            raise ConfigError("step() before reset(): reset the environments first")
        obs, reward, terminated, truncated, info = self.env.step(self._to_env(torch.as_tensor(actions)))
        obs = self._tensor(obs)
        terminated, truncated = self._tensor(terminated).bool(), self._tensor(truncated).bool()
        info = self._tensor(info, obs)
        if self._emulate:
            done = terminated | truncated
            if bool(done.any()):
                final = obs
                obs, _ = self.reset(options={"reset_mask": done})
                info = {**info, "final_obs": final, "_final_obs": done}
        return obs, self._tensor(reward), terminated, truncated, info

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()

    def __repr__(self) -> str:
        kind = "numpy" if self._numpy else "torch" if self._numpy is not None else "?"
        return (f"TorchVectorEnv({type(self.env).__name__}, num_envs={self.num_envs}, {kind} -> {self.device}, "
                f"autoreset_mode={self.autoreset_mode!r})")
