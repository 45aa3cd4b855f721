"""Observation and action spaces: gymnasium's own when it is installed, else a tiny compatible stand-in.

gymnasium is optional for the library (it is a test and benchmark
dependency), so the environments describe their spaces through
:func:`box` and :func:`discrete`. With gymnasium installed these return
``gymnasium.spaces.Box`` / ``Discrete`` (and :func:`batch` uses
``gymnasium.vector.utils.batch_space``), so code that checks
``isinstance(space, gymnasium.spaces.Box)`` works. Without it, :class:`Box`
and :class:`Discrete` below carry the same attributes (``shape``, ``dtype``,
``low``, ``high``, ``n``, ``contains``, ``sample``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Box", "Discrete", "MultiDiscrete", "batch", "box", "discrete"]


def _gymnasium():
    try:
        import gymnasium
    except ImportError:
        return None
    return gymnasium


@dataclass(frozen=True)
class Box:
    """A stand-in for ``gymnasium.spaces.Box``: a bounded array of floats."""

    low: np.ndarray
    high: np.ndarray
    shape: tuple[int, ...]
    dtype: np.dtype = field(default=np.dtype(np.float32))

    def contains(self, x) -> bool:
        x = np.asarray(x)
        return x.shape == self.shape and bool(np.all(x >= self.low) and np.all(x <= self.high))

    def sample(self, rng: np.random.Generator | None = None) -> np.ndarray:
        rng = rng or np.random.default_rng()
        low = np.where(np.isfinite(self.low), self.low, -1.0)
        high = np.where(np.isfinite(self.high), self.high, 1.0)
        return rng.uniform(low, high, size=self.shape).astype(self.dtype)


@dataclass(frozen=True)
class Discrete:
    """A stand-in for ``gymnasium.spaces.Discrete``: one of ``0 .. n-1``."""

    n: int
    shape: tuple[int, ...] = ()
    dtype: np.dtype = field(default=np.dtype(np.int64))

    def contains(self, x) -> bool:
        x = np.asarray(x)
        return x.shape == () and 0 <= int(x) < self.n

    def sample(self, rng: np.random.Generator | None = None) -> np.int64:
        return np.int64((rng or np.random.default_rng()).integers(self.n))


@dataclass(frozen=True)
class MultiDiscrete:
    """A stand-in for ``gymnasium.spaces.MultiDiscrete``: the batch of a :class:`Discrete`."""

    nvec: np.ndarray
    shape: tuple[int, ...]
    dtype: np.dtype = field(default=np.dtype(np.int64))

    def contains(self, x) -> bool:
        x = np.asarray(x)
        return x.shape == self.shape and bool(np.all((x >= 0) & (x < self.nvec)))

    def sample(self, rng: np.random.Generator | None = None) -> np.ndarray:
        return (rng or np.random.default_rng()).integers(self.nvec).astype(self.dtype)


def box(low, high, shape: tuple[int, ...], dtype=np.float32):
    """``gymnasium.spaces.Box(low, high, shape, dtype)``, or the stand-in."""
    gym = _gymnasium()
    low = np.broadcast_to(np.asarray(low, dtype=dtype), shape).copy()
    high = np.broadcast_to(np.asarray(high, dtype=dtype), shape).copy()
    if gym is not None:
        return gym.spaces.Box(low, high, shape=shape, dtype=dtype)
    return Box(low, high, tuple(shape), np.dtype(dtype))


def discrete(n: int):
    """``gymnasium.spaces.Discrete(n)``, or the stand-in."""
    gym = _gymnasium()
    return gym.spaces.Discrete(n) if gym is not None else Discrete(int(n))


def batch(space, n: int):
    """The space of ``n`` stacked samples of ``space`` (``gymnasium.vector.utils.batch_space``)."""
    gym = _gymnasium()
    if gym is not None and isinstance(space, gym.spaces.Space):
        from gymnasium.vector.utils import batch_space

        return batch_space(space, n)
    if isinstance(space, Discrete):
        return MultiDiscrete(np.full(n, space.n, dtype=np.int64), (n,))
    return Box(np.stack([space.low] * n), np.stack([space.high] * n), (n, *space.shape), space.dtype)
