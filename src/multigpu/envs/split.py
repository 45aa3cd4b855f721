"""Environments split over ranks, and random streams keyed by each environment's global id.

Runs inside each rank. ``num_envs`` is global: rank ``r`` of ``world_size``
builds the environments ``shard_bounds(num_envs, r, world_size)``, a contiguous
slice of the global ids, so concatenating every rank's observations in rank
order gives the single-process batch.

Randomness (the initial states drawn at each reset) comes from a counter-based
hash, not from a generator that advances as it is used: the ``k``-th number of
the ``c``-th reset of environment ``g`` under seed ``s`` is
``uniform(hash(s, g, c, k))``. It depends on nothing else - not on the rank,
the number of ranks, which other environments reset, or the device's
generator - so trajectories are bit-identical however the environments are
split (docs/architecture.md, "Independent of the split").

The hash is Chris Wellons' ``lowbias32`` (two multiply-xorshift rounds, a
well-tested 32-bit integer mixer), computed in int64 tensors with every
product kept below 2**63, so it gives the same bits on any device.

    >>> env_id_range(10, rank=1, world_size=3)
    range(4, 7)
"""

from __future__ import annotations

import numpy as np
import torch

from multigpu.runtime.sharding import shard_bounds

__all__ = ["env_id_range", "mix32", "mix32_np", "stream_keys", "uniform_bits_np", "uniforms", "uniforms_np"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2**32 / phi: spreads consecutive counters apart before mixing
_DRAW = 0x85EBCA6B  # spreads the draw index k
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers


def env_id_range(num_envs: int, *, rank: int | None = None, world_size: int | None = None) -> range:
    """Global ids of the environments this rank builds (pure; defaults from :func:`multigpu.init`).

    Example (world_size=2)::

        env_id_range(5)   # rank 0 -> range(0, 3); rank 1 -> range(3, 5)
    """
    if rank is None or world_size is None:
        from multigpu.runtime import group

        rank = group.rank() if rank is None else rank
        world_size = group.world_size() if world_size is None else world_size
    start, stop = shard_bounds(num_envs, rank, world_size)
    return range(start, stop)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2**32`` for x in [0, 2**32), with no int64 overflow.

    A constant >= 2**31 is replaced by ``c - 2**32`` (the same modulo 2**32),
    so ``|x * c| < 2**63`` either way; ``& 0xFFFFFFFF`` of the two's-complement
    product keeps the right low bits.
    """
    return (x * (c - (1 << 32) if c >= 1 << 31 else c)) & _MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective 32-bit mixer; ``x`` is int64 with values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


def mix32_np(x: np.ndarray) -> np.ndarray:
    """:func:`mix32` on a ``np.uint32`` array, in place (uint32 wraps by itself): the same bits."""
    shifted = np.empty_like(x)  # one scratch array for the three shifts
    for shift, multiplier in ((16, _M1), (15, _M2), (16, None)):
        np.right_shift(x, shift, out=shifted)
        np.bitwise_xor(x, shifted, out=x)
        if multiplier is not None:
            np.multiply(x, np.uint32(multiplier), out=x)
    return x


def _fold_seed(seed: int) -> int:
    """A Python int of any size -> 32 bits (all of its bits matter)."""
    seed = int(seed) & ((1 << 64) - 1)
    low, high = seed & _MASK32, seed >> 32
    return low ^ int(mix32(torch.tensor([high ^ _GOLDEN], dtype=torch.int64)).item())


def stream_keys(seed: int, env_ids: torch.Tensor) -> torch.Tensor:
    """Per-environment 32-bit keys for ``seed``: ``mix(seed ^ mix(global id))``."""
    ids = env_ids.to(torch.int64) & _MASK32
    return mix32(mix32(ids ^ _GOLDEN) ^ _fold_seed(seed))


def uniforms(keys: torch.Tensor, counts: torch.Tensor, num: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``num`` numbers in [0, 1) for each (key, reset count): shape ``(num, len(keys))``.

    Number ``k`` of reset ``c`` under key ``s`` is ``mix(mix(s ^ c * G) ^ k * D) >> 8`` over 2**24:
    a 24-bit fraction, exact in float32 and float64 alike, so the drawn states
    are the same bits whatever the dtype's rounding.
    """
    base = mix32(keys ^ _mul32(counts.to(torch.int64) & _MASK32, _GOLDEN))
    k = _mul32(torch.arange(1, num + 1, device=keys.device, dtype=torch.int64), _DRAW)
    bits = mix32(base.unsqueeze(0) ^ k.unsqueeze(1))
    return (bits >> 8).to(dtype) * (1.0 / (1 << 24))


def uniforms_np(keys: np.ndarray, counts: np.ndarray, num: int) -> np.ndarray:
    """:func:`uniforms` for CPU arrays (``keys`` uint32, ``counts`` any int): the same values, as float32.

    NumPy's uint32 arithmetic wraps by itself and its small-array overhead is
    a fraction of torch's eager kernels', which matters for the few
    environments that reset in one step.
    """
    return uniform_bits_np(keys, counts, num).astype(np.float32) * np.float32(1.0 / (1 << 24))


def uniform_bits_np(keys: np.ndarray, counts: np.ndarray, num: int) -> np.ndarray:
    """The 24-bit integers behind :func:`uniforms_np` (``uniforms = bits / 2**24``), as an int32 array ``(num, len(keys))``.

    Every value is exact in float32 and float64, and so is ``bits * (scale / 2**24)``
    against ``(bits / 2**24) * scale`` (a power of two changes no significand):
    a caller that scales the draws folds the ``2**-24`` into its scale and saves a pass.
    """
    base = mix32_np(keys ^ counts.astype(np.uint32) * np.uint32(_GOLDEN))
    bits = mix32_np(base[None, :] ^ _draw_spread(num))
    bits >>= np.uint32(8)
    # values < 2**24: the int32 view converts with one SIMD instruction, uint32 does not; both are exact
    return bits.view(np.int32)


_SPREADS: dict[int, np.ndarray] = {}


def _draw_spread(num: int) -> np.ndarray:
    """``k * D`` for draws k = 1..num, as a ``(num, 1)`` uint32 column (made once per num)."""
    if num not in _SPREADS:
        _SPREADS[num] = (np.arange(1, num + 1, dtype=np.uint32) * np.uint32(_DRAW))[:, None]
    return _SPREADS[num]
