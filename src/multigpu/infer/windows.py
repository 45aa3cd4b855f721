"""Window positions for sliding-window inference (pure index math, no tensors, no communication).

Runs inside each rank (and in the launcher, to validate input). Positions are
MONAI's ``sliding_window_inference`` ones, so results can be compared with it:

* an image smaller than the roi in some dimension is padded up to the roi there,
  ``diff // 2`` before and the rest after;
* the scan interval is ``int(roi * (1 - overlap))`` (at least 1), or ``roi`` where the
  padded image is exactly one roi long;
* windows start at ``0, interval, 2 * interval, ...`` until one reaches the end; the
  last start is pulled back so that window ends at the image's edge;
* windows are numbered row-major over the per-dimension starts (the first spatial
  dimension varies slowest), image after image.

Glossary: a *window* is one inference tile of ``roi`` voxels of the padded input;
its *output region* is the same tile scaled by the model's integer ``scale``.
Windows are spread over ranks in whole *batches* of ``batch_size`` consecutive
windows (``batch_bounds``), so every window lands on exactly one rank, each
rank's windows are contiguous in space, and the model sees the same batches on
any number of ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from multigpu.errors import ConfigError
from multigpu.runtime.sharding import shard_bounds

__all__ = ["WindowGrid", "WindowPlan", "as_tuple", "make_grid", "pad_widths", "scan_interval"]


def as_tuple(value: int | float | Sequence, ndim: int, name: str) -> tuple:
    """``value`` repeated over ``ndim`` spatial dimensions, or checked to have ``ndim`` entries."""
    if isinstance(value, (int, float)):
        return (value,) * ndim
    value = tuple(value)
    if len(value) == 1:
        return value * ndim
    if len(value) != ndim:
        raise ConfigError(f"{name}={list(value)} has {len(value)} entries; the inputs have {ndim} spatial dims "
                          f"(give one value or {ndim})")
    return value


def pad_widths(image_size: Sequence[int], roi: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """``(before, after)`` padding per spatial dim that brings the image up to the roi (MONAI's split)."""
    out = []
    for size, r in zip(image_size, roi, strict=True):
        diff = max(r - size, 0)
        out.append((diff // 2, diff - diff // 2))
    return tuple(out)


def scan_interval(padded_size: Sequence[int], roi: Sequence[int], overlap: Sequence[float]) -> tuple[int, ...]:
    """Distance between window starts per dim: ``int(roi * (1 - overlap))``, at least 1; ``roi`` if one window fits."""
    out = []
    for size, r, o in zip(padded_size, roi, overlap, strict=True):
        out.append(r if r == size else max(int(r * (1 - o)), 1))
    return tuple(out)


def _starts(size: int, roi: int, interval: int) -> tuple[int, ...]:
    count = 1
    while (count - 1) * interval + roi < size:
        count += 1
    return tuple(min(i * interval, size - roi) for i in range(count))


@dataclass(frozen=True)
class WindowGrid:
    """The windows of one image: per-dimension starts, numbered row-major."""

    image_size: tuple[int, ...]
    """Spatial size of the image as given."""
    roi: tuple[int, ...]
    pad: tuple[tuple[int, int], ...]
    """``(before, after)`` padding per dim (non-zero only where the image is smaller than the roi)."""
    interval: tuple[int, ...]
    starts: tuple[tuple[int, ...], ...]
    """Window starts per dim, in padded input coordinates."""

    @property
    def ndim(self) -> int:
        return len(self.image_size)

    @property
    def padded_size(self) -> tuple[int, ...]:
        return tuple(s + a + b for s, (a, b) in zip(self.image_size, self.pad, strict=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """Windows per dim."""
        return tuple(len(s) for s in self.starts)

    @property
    def num_windows(self) -> int:
        return math.prod(self.shape)

    @property
    def strides(self) -> tuple[int, ...]:
        """Row-major multipliers: window number = sum(grid_index[d] * strides[d])."""
        out, acc = [], 1
        for n in reversed(self.shape):
            out.append(acc)
            acc *= n
        return tuple(reversed(out))

    def grid_index(self, k: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(k, self.shape))

    def start(self, k: int) -> tuple[int, ...]:
        """Start of window ``k`` in padded input coordinates."""
        return tuple(self.starts[d][i] for d, i in enumerate(self.grid_index(k)))

    def first_cover(self, dim: int, coords: np.ndarray, scale: int = 1) -> np.ndarray:
        """For output coordinates along ``dim`` (padded, times ``scale``), the lowest grid index covering each."""
        ends = (np.asarray(self.starts[dim], dtype=np.int64) + self.roi[dim]) * scale
        return np.searchsorted(ends, np.asarray(coords, dtype=np.int64), side="right")

    def first_window(self, coords: Sequence[np.ndarray], scale: Sequence[int]) -> np.ndarray:
        """Lowest window number covering each output voxel of the box ``coords[0] x coords[1] x ...``.

        Because numbering is row-major, the lowest window over a box of grid
        indices is the one built from each dimension's lowest index.
        """
        out = np.zeros((1,) * self.ndim, dtype=np.int64)
        for d, c in enumerate(coords):
            idx = self.first_cover(d, c, scale[d]) * self.strides[d]
            out = out + idx.reshape((1,) * d + (-1,) + (1,) * (self.ndim - d - 1))
        return out


def make_grid(image_size: Sequence[int], roi: Sequence[int], overlap: Sequence[float]) -> WindowGrid:
    """The window grid of one image (see the module docstring for the rules)."""
    image_size = tuple(int(s) for s in image_size)
    roi = tuple(int(r) for r in roi)
    if any(s < 1 for s in image_size):
        raise ConfigError(f"image of spatial size {image_size} is empty")
    pad = pad_widths(image_size, roi)
    padded = tuple(s + a + b for s, (a, b) in zip(image_size, pad, strict=True))
    interval = scan_interval(padded, roi, overlap)
    starts = tuple(_starts(s, r, i) for s, r, i in zip(padded, roi, interval, strict=True))
    return WindowGrid(image_size=image_size, roi=roi, pad=pad, interval=interval, starts=starts)


@dataclass(frozen=True)
class Window:
    """One window: its global number, its image, its number within the image, and its start."""

    index: int
    image: int
    local: int
    start: tuple[int, ...]


class WindowPlan:
    """All windows of a list of images, numbered image after image, and their split over ranks."""

    def __init__(self, image_sizes: Sequence[Sequence[int]], roi: Sequence[int], overlap: Sequence[float]):
        self.grids = [make_grid(s, roi, overlap) for s in image_sizes]
        counts = [g.num_windows for g in self.grids]
        self.offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(counts)]))
        self.num_windows = self.offsets[-1]

    def window(self, index: int) -> Window:
        image = int(np.searchsorted(self.offsets, index, side="right")) - 1
        local = index - self.offsets[image]
        return Window(index, image, local, self.grids[image].start(local))

    def windows(self, start: int, stop: int) -> Iterator[Window]:
        for i in range(start, stop):
            yield self.window(i)

    def rank_bounds(self, batch_size: int, world_size: int) -> list[tuple[int, int]]:
        """``(start, stop)`` window range of every rank: whole batches, sharded like ``mg.shard``."""
        num_batches = -(-self.num_windows // batch_size)
        out = []
        for r in range(world_size):
            b0, b1 = shard_bounds(num_batches, r, world_size)
            out.append((min(b0 * batch_size, self.num_windows), min(b1 * batch_size, self.num_windows)))
        return out

    def owner(self, index: np.ndarray | int, bounds: Sequence[tuple[int, int]]) -> np.ndarray:
        """Rank that evaluates each global window number, for the split ``bounds``."""
        starts = np.asarray([b[0] for b in bounds], dtype=np.int64)
        return np.searchsorted(starts, np.asarray(index, dtype=np.int64), side="right") - 1

    def covers(self, image: int, local: int, scale: Sequence[int]) -> tuple[range, ...]:
        """Output box of window ``local`` of ``image``, in padded output coordinates."""
        grid = self.grids[image]
        return tuple(range(s * z, (s + r) * z) for s, r, z in zip(grid.start(local), grid.roi, scale, strict=True))

    def first_windows_inside(self, image: int, local: int, scale: Sequence[int]) -> np.ndarray:
        """Global numbers of the lowest covering window of every voxel of window ``local``'s output box (unique)."""
        grid = self.grids[image]
        box = self.covers(image, local, scale)
        ranges = []
        for d, b in enumerate(box):
            lo, hi = grid.first_cover(d, np.array([b.start, b.stop - 1]), scale[d])
            ranges.append(range(int(lo), int(hi) + 1))
        combos = np.array(list(itertools.product(*ranges)), dtype=np.int64).reshape(-1, grid.ndim)
        return np.unique(combos @ np.asarray(grid.strides, dtype=np.int64)) + self.offsets[image]

    def images_in(self, start: int, stop: int) -> range:
        """Images that have at least one window numbered in ``[start, stop)``."""
        if start >= stop:
            return range(0)
        return range(self.window(start).image, self.window(stop - 1).image + 1)

    def output_box(self, image: int, start: int, stop: int, scale: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """Padded output box touched by ``image``'s windows numbered in ``[start, stop)`` (must be some)."""
        grid = self.grids[image]
        lo = max(start, self.offsets[image]) - self.offsets[image]
        hi = min(stop, self.offsets[image + 1]) - self.offsets[image]
        if lo >= hi:
            raise ValueError(f"no window of image {image} is numbered in [{start}, {stop})")
        idx = np.unravel_index(np.arange(lo, hi), grid.shape)
        return tuple(
            (grid.starts[d][int(i.min())] * z, (grid.starts[d][int(i.max())] + grid.roi[d]) * z)
            for d, (i, z) in enumerate(zip(idx, scale, strict=True))
        )

    def crop_box(self, image: int, scale: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The image itself (without padding) in padded output coordinates."""
        grid = self.grids[image]
        return tuple(
            (a * z, (a + s) * z) for (a, _), s, z in zip(grid.pad, grid.image_size, scale, strict=True)
        )

    def segments(self, image: int, dim: int, lo: int, hi: int, scale: int) -> list[tuple[int, int, int]]:
        """Split output coordinates ``[lo, hi)`` along ``dim`` into runs with one lowest covering grid index.

        Returns ``(start, stop, grid_index)`` triples. Over a product of such runs
        (a *block*) the lowest covering window, hence the owner, is one and the same.
        """
        grid = self.grids[image]
        ends = (np.asarray(grid.starts[dim], dtype=np.int64) + grid.roi[dim]) * scale
        cuts = sorted({lo, hi, *(int(e) for e in ends if lo < e < hi)})
        first = grid.first_cover(dim, np.asarray(cuts[:-1]), scale)
        return [(a, b, int(i)) for a, b, i in zip(cuts[:-1], cuts[1:], first, strict=True)]
