"""Exactly-once sharding: which items belong to which rank (pure index math, no communication).

Every function here is a pure function of ``(n, rank, world_size)``. Shards
are contiguous and in rank order, so concatenating them in rank order gives
back the original sequence: that is what makes ``gather`` order-preserving.
Sizes differ by at most one; lower ranks get the extra items; a rank may get
nothing when ``world_size > n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from multigpu.errors import ConfigError

__all__ = ["rank_and_world_size", "shard", "shard_bounds", "shard_range", "shard_sizes"]

T = TypeVar("T")


def _check(n: int, rank: int, world_size: int) -> None:
    if n < 0:
        raise ConfigError(f"cannot shard {n} items; the count must be >= 0")
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} must be in [0, {world_size})")


def shard_sizes(n: int, world_size: int) -> list[int]:
    """How many items each rank gets: ``[ceil, ..., ceil, floor, ...]``, summing to ``n``."""
    _check(n, 0, world_size)
    base, extra = divmod(n, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def shard_bounds(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, stop)`` of ``rank``'s contiguous slice of ``range(n)``."""
    _check(n, rank, world_size)
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``(rank, world_size)`` as given, each one None taken from the job (``mg.rank()``, ``mg.world_size()``)."""
    if rank is None or world_size is None:
        from multigpu.runtime import group

        rank = group.rank() if rank is None else rank
        world_size = group.world_size() if world_size is None else world_size
    return rank, world_size


def shard_range(n: int, *, rank: int | None = None, world_size: int | None = None) -> range:
    """This rank's indices of ``range(n)``.

    Example (world_size=2)::

        shard_range(5)   # rank 0 -> range(0, 3); rank 1 -> range(3, 5)
    """
    start, stop = shard_bounds(n, *rank_and_world_size(rank, world_size))
    return range(start, stop)


def shard(
    items: Sequence[T], *, pad: bool = False, rank: int | None = None, world_size: int | None = None
) -> Sequence[T]:
    """Return this rank's contiguous slice of ``items``.

    Slices differ in length by at most one; lower ranks get the extra items.
    Pure function of (len(items), rank, world_size): no communication.

    Args:
        items: The full sequence, identical on every rank.
        pad: Repeat the slice's last item (or the sequence's last, for an empty
            slice) so every rank gets the same length, as fixed-shape
            collectives need. The padding is not real work: drop it after
            gathering (``gather`` of unpadded parts needs none).
        rank: Overrides this rank's from :func:`multigpu.init`.
        world_size: Overrides the job's from :func:`multigpu.init`.

    Returns:
        The slice for this rank.

    Example (world_size=2)::

        shard(["a", "b", "c"])            # rank 0 -> ["a", "b"]; rank 1 -> ["c"]
        shard(["a", "b", "c"], pad=True)  # rank 0 -> ["a", "b"]; rank 1 -> ["c", "c"]
    """
    rank, world_size = rank_and_world_size(rank, world_size)
    start, stop = shard_bounds(len(items), rank, world_size)
    part = items[start:stop]
    if pad and len(items):
        target = -(-len(items) // world_size)
        filler = part[-1:] if len(part) else items[-1:]
        while len(part) < target:
            part = part + filler
    return part
