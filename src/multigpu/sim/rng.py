"""Counter-based random numbers keyed by (seed, agent id, step, stream) (pure; inside each rank).

An agent's numbers never depend on its rank, its position in a tensor or the
order in which chunks run: ``random_bits(ids, key)`` is a fixed hash of the
agent id and a per-(seed, step, stream) key, so any partition of the agents
draws exactly the same numbers. This is what makes results bit-identical on
1, 2 or 3 ranks and across strategies.

The hash is Chris Wellons' ``lowbias32`` on int32 tensors (wrapping multiply,
logical shifts done as an arithmetic shift plus a mask), applied to
``id * 0x9E3779B1 ^ key``. For a fixed key it is a bijection of 32-bit ids, so
no two agents share a draw within a step; the key is a 64-bit splitmix hash
of (seed, step, stream) folded to 32 bits, computed once per step in Python.
Agent ids must fit in int31 (up to 2,147,483,647 agents).

Example::

    key = step_key(seed=0, step=5, stream=STREAM_MOVE)
    bits = random_bits(ids, key)                    # int32, all 32 bits random
    u = uniform(bits)                               # float32 in [0, 1)
    hit = low_bits(bits, 24) < threshold(0.3, 24)   # exact integer form of "u < 0.3"
"""

from __future__ import annotations

import torch

__all__ = [
    "STREAM_INIT",
    "STREAM_MARKET",
    "STREAM_MOVE",
    "STREAM_TRANSITION",
    "hash32",
    "low_bits",
    "mix_ids",
    "random_bits",
    "reference_bits",
    "step_key",
    "threshold",
    "uniform",
]

STREAM_INIT = 0
STREAM_MOVE = 1
STREAM_TRANSITION = 2
STREAM_MARKET = 3

_M64 = (1 << 64) - 1
_GOLDEN32 = 0x9E3779B1
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B - (1 << 32)  # as a signed int32 constant


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def step_key(seed: int, step: int, stream: int) -> int:
    """The 32-bit key (as a signed int) of one (seed, step, stream); step may be -1 for initial state."""
    z = _splitmix64(_splitmix64(_splitmix64(seed) ^ (step & _M64)) ^ stream)
    z = (z ^ (z >> 32)) & 0xFFFFFFFF
    return z - (1 << 32) if z >= 1 << 31 else z


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int32 tensor (two's-complement wrap-around)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _MUL1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _MUL2
    return x ^ ((x >> 16) & 0xFFFF)


def mix_ids(ids: torch.Tensor) -> torch.Tensor:
    """The first half of :func:`random_bits`, the same for every key: ``random_bits(ids, k) ==
    hash32(mix_ids(ids) ^ k)`` (a loop over keys computes it once)."""
    return ids.to(torch.int32) * (_GOLDEN32 - (1 << 32))


def random_bits(ids: torch.Tensor, key: int) -> torch.Tensor:
    """32 random bits (int32) per agent id for the given :func:`step_key`."""
    return hash32(mix_ids(ids) ^ key)


def low_bits(bits: torch.Tensor, n: int, shift: int = 0) -> torch.Tensor:
    """``n`` bits of ``bits`` starting at bit ``shift``, as a non-negative int32 (n <= 31)."""
    return (bits >> shift) & ((1 << n) - 1)


def threshold(p: float, n: int = 24) -> int:
    """The integer t with ``low_bits(bits, n) < t`` true with probability p (rounded down to 2**-n)."""
    p = min(max(float(p), 0.0), 1.0)
    return int(p * (1 << n))


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """A float32 in [0, 1) from the top 24 bits (exactly representable)."""
    return low_bits(bits, 24, shift=8).to(torch.float32) * (1.0 / (1 << 24))


def reference_bits(agent_id: int, key: int) -> int:
    """Pure-Python :func:`random_bits` for one id (the specification the tests compare against)."""
    m = 0xFFFFFFFF
    x = ((agent_id * _GOLDEN32) & m) ^ (key & m)
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    x ^= x >> 16
    return x - (1 << 32) if x >= 1 << 31 else x
