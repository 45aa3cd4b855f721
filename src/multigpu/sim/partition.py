"""Which rank owns which grid rows: strips, and borders moved to balance agents (pure).

A *partition* is a list of ``world_size + 1`` row borders: rank r owns rows
``[borders[r], borders[r + 1])`` of the grid (full width), at least one row
each. No communication here; :mod:`multigpu.sim.exchange` moves the agents.

Example (10 rows, world_size=3)::

    even_borders(10, 3)                         # [0, 4, 7, 10]
    balanced_borders([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 3)   # [0, 1, 5, 10]: rank 0 holds the crowded row
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from multigpu.runtime.sharding import shard_bounds

__all__ = ["balanced_borders", "best_tiles", "even_borders", "halo_cells", "imbalance", "row_owner", "rows_of"]


def even_borders(rows: int, world_size: int) -> list[int]:
    """Strips of (nearly) equal height; lower ranks get the extra rows."""
    if world_size > rows:
        raise ValueError(f"{rows} rows cannot give each of {world_size} ranks a row")
    borders = [0]
    for r in range(world_size):
        borders.append(shard_bounds(rows, r, world_size)[1])
    return borders


def balanced_borders(row_counts: Sequence[int] | torch.Tensor, world_size: int) -> list[int]:
    """Borders that give each rank about ``total / world_size`` agents, at least one row each.

    Border k is put where the running agent count is closest to ``k * total / world_size``
    (exact integer arithmetic, so every rank computes the same borders).
    """
    counts = torch.as_tensor(row_counts, dtype=torch.int64)
    rows = counts.numel()
    if world_size > rows:
        raise ValueError(f"{rows} rows cannot give each of {world_size} ranks a row")
    prefix = torch.cumsum(counts, 0).tolist()  # prefix[i] = agents in rows [0, i]
    total = prefix[-1] if prefix else 0
    borders = [0]
    for k in range(1, world_size):
        # agents before border b = prefix[b - 1]; want prefix[b - 1] * world_size close to k * total
        target = k * total
        lo, hi = borders[-1] + 1, rows - (world_size - k)
        best, best_err = lo, None
        b = _first_at_least(prefix, target, world_size, lo, hi)
        for cand in (b - 1, b):
            if lo <= cand <= hi:
                err = abs(prefix[cand - 1] * world_size - target)
                if best_err is None or err < best_err:
                    best, best_err = cand, err
        borders.append(best)
    borders.append(rows)
    return borders


def _first_at_least(prefix: list[int], target: int, scale: int, lo: int, hi: int) -> int:
    """Smallest b in [lo, hi] with prefix[b - 1] * scale >= target (hi if none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if prefix[mid - 1] * scale >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def row_owner(borders: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 tensor mapping each row to the rank that owns it."""
    # from the Python borders: no size read back from a device (repeat_interleave's would be a GPU sync)
    owners = [r for r in range(len(borders) - 1) for _ in range(borders[r + 1] - borders[r])]
    return torch.tensor(owners, dtype=torch.int32).to(device)


def rows_of(borders: Sequence[int], rank: int) -> tuple[int, int]:
    """The rows ``[lo, hi)`` rank ``rank`` owns."""
    return borders[rank], borders[rank + 1]


def imbalance(agent_counts: Sequence[int]) -> float:
    """Load imbalance of agent counts per rank: max / mean (1.0 = even)."""
    counts = list(agent_counts)
    mean = sum(counts) / len(counts) if counts else 0
    return max(counts) / mean if mean > 0 else 1.0


def halo_cells(grid: Sequence[int], px: int, py: int, radius: int) -> int:
    """Cells one rank receives per halo exchange when the periodic grid is cut into ``px`` x ``py`` tiles.

    ``px`` tiles down (rows), ``py`` across (columns); strips are ``(world_size, 1)``. A rank needs
    ``radius`` rows from above and below (when ``px > 1``), ``radius`` columns from left and right (when
    ``py > 1``) and the four ``radius x radius`` corners (when both). The largest tile counts
    (the slowest rank sets the pace).
    """
    h, w = -(-grid[0] // px), -(-grid[1] // py)
    rows, cols = px > 1, py > 1
    return 2 * radius * (w * rows + h * cols) + 4 * radius * radius * (rows and cols)


def best_tiles(grid: Sequence[int], world_size: int, radius: int) -> tuple[int, int]:
    """The ``(px, py)`` with ``px * py == world_size`` whose :func:`halo_cells` is least; strips win ties.

    On a square grid, tiles beat strips only from 6 ranks on (2 x 3: 5/3 r W against 2 r W): at 4 ranks
    2 x 2 needs the strips' 2 r W plus 4 r^2 corner cells, and 2 and 3 ranks have no layout but strips.
    """
    layouts = [(world_size // py, py) for py in range(1, world_size + 1) if world_size % py == 0]
    layouts = [(px, py) for px, py in layouts if px <= grid[0] and py <= grid[1]]
    return min(layouts, key=lambda t: (halo_cells(grid, *t, radius), t[1]))
