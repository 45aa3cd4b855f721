"""The environments' registry: ids to factories, and :func:`make`, which builds a rank's share of them.

The built-in environments (:mod:`multigpu.envs.cartpole`, :mod:`multigpu.envs.pendulum`) register themselves when
the package :mod:`multigpu.envs` is imported, which importing this module does first.
"""

from __future__ import annotations

import difflib
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import torch

from multigpu.envs.adapter import build
from multigpu.envs.split import env_id_range
from multigpu.errors import ConfigError

__all__ = ["make", "register", "registered_ids"]

_REGISTRY: dict[str, Callable[..., Any]] = {}


def register(env_id: str, factory: Callable[..., Any]) -> None:
    """Make ``factory`` available to :func:`make` (and ``multigpu rl env_id=...`` in this process) as ``env_id``.

    ``factory`` is called with the arguments it names among ``num_envs``, ``env_ids``, ``seed``,
    ``device``, ``autoreset_mode``, ``max_episode_steps`` and ``dtype``, and may return a
    :class:`VectorEnv` or any gymnasium 1.x vector environment (NumPy or torch), which is
    wrapped to hand back tensors (:mod:`multigpu.envs.adapter`)::

        mg.envs.register("MyPendulum-v0", lambda num_envs, seed: gymnasium.make_vec("Pendulum-v1", num_envs))
        envs = mg.envs.make("MyPendulum-v0", num_envs=8, seed=0)
    """
    if not isinstance(env_id, str) or not env_id or not callable(factory):
        raise ConfigError(f"register({env_id!r}, {factory!r}): give an id (a non-empty string) and a callable")
    _REGISTRY[env_id] = factory


def registered_ids() -> list[str]:
    """The ids :func:`make` accepts."""
    return sorted(_REGISTRY)


def _shared_seed() -> int:
    """A fresh random seed, the same on every rank (rank 0's, broadcast)."""
    from multigpu.runtime import collectives, group

    seed = secrets.randbits(32)
    if group.is_initialized() and group.world_size() > 1:
        seed = collectives.broadcast_object(seed, src=0)
    return seed


def make(
    env_id: str,
    num_envs: int,
    *,
    device: str | torch.device | None = None,
    seed: int | None = None,
    split: bool = False,
    autoreset_mode: str = "next_step",
    max_episode_steps: int | None = None,
    dtype: torch.dtype | None = None,
    kwargs: Mapping[str, Any] | None = None,
) -> Any:
    """Build ``num_envs`` batched environments of ``env_id``; with ``split=True``, this rank's share of them.

    Args:
        env_id: One of :func:`registered_ids` ("CartPole-v1", "Pendulum-v1", yours from :func:`register`),
            or ``package.module:factory``, an environment factory (:mod:`multigpu.envs.adapter`).
        num_envs: How many environments; the global count when ``split``.
        device: Where they step (default: :func:`multigpu.device` after ``init()``, else CPU).
        seed: Base seed; None draws one (the same on every rank when ``split``).
        split: Build only this rank's contiguous share of the global env ids
            (call on all ranks when ``seed`` is None: the drawn seed is broadcast).
        autoreset_mode: "next_step" (gymnasium's default), "same_step" or "disabled"
            (a factory that does not take it keeps its own: ``envs.autoreset_mode`` says which).
        max_episode_steps: Override the environment's time limit.
        dtype: torch.float32 (the built-ins' default) or torch.float64.
        kwargs: More keyword arguments for a factory.

    Returns:
        A :class:`VectorEnv`, or a factory's environment wrapped to hand back tensors
        (:class:`~multigpu.envs.adapter.TorchVectorEnv`).

    Example (world_size=2)::

        envs = mg.envs.make("CartPole-v1", num_envs=5, seed=0, split=True)
        envs.env_ids   # rank 0 -> tensor([0, 1, 2]); rank 1 -> tensor([3, 4])
    """
    if env_id in _REGISTRY:
        factory, what = _REGISTRY[env_id], f"environment {env_id!r}"
    elif isinstance(env_id, str) and ":" in env_id:
        from multigpu.factory import import_object

        factory, what = import_object(env_id, what="env factory", callable_only=True), f"env factory {env_id!r}"
    else:
        close = difflib.get_close_matches(str(env_id), list(_REGISTRY), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"unknown environment {env_id!r}.{hint} Valid: {', '.join(sorted(_REGISTRY))}, "
                          "or package.module:factory")
    if isinstance(num_envs, bool) or not isinstance(num_envs, int) or num_envs < 1:
        raise ConfigError(f"num_envs={num_envs!r} must be a whole number >= 1")
    if device is None:
        from multigpu.runtime import group

        device = group.current_device()
    if seed is None:
        seed = _shared_seed() if split else secrets.randbits(32)
    env_ids = env_id_range(num_envs) if split else range(num_envs)
    return build(factory, env_ids, seed=seed, device=device, what=what, kwargs=kwargs,
                 autoreset_mode=autoreset_mode, max_episode_steps=max_episode_steps, dtype=dtype)
