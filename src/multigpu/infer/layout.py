"""How ``sliding_window``'s output is cut for assembly, and which rank owns each part (pure: no communication).

Each output voxel belongs to the rank holding its *lowest* covering window (that rank adds the windows of
later ranks that touch its voxels after its own, in window order: the exchange). Per image, the output is cut
into slabs of rows with one lowest covering window row, at most ``SLAB_VOXELS`` voxels each, and each slab into
blocks owned by one rank. The same on every rank; the exchange and the assembly both walk it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Sequence

import torch

from multigpu.infer.stats import EXCHANGE_STATS
from multigpu.infer.stitch import Canvas
from multigpu.infer.windows import WindowPlan

__all__ = ["SLAB_VOXELS", "Block", "Box", "OutputLayout"]

SLAB_VOXELS = 1 << 22
"""Voxels per assembly slab: bounds rank 0's receive buffers (x world_size x channels)."""

Box = tuple[tuple[int, int], ...]
"""``((start, stop), ...)`` per spatial dim, in output voxels of the padded image."""
Block = tuple[Box, int]
"""A block of a slab and the rank that owns it."""


class OutputLayout:
    """How the output is cut for assembly: per image, slabs of rows, each cut into blocks owned by one rank (the
    rank of its lowest covering window). The same on every rank; no communication."""

    def __init__(self, plan: WindowPlan, rank_bounds: Sequence[tuple[int, int]], acc_dtype: torch.dtype):
        self.plan, self.rank_bounds, self.acc_dtype = plan, rank_bounds, acc_dtype

    def blocks(self, image: int, rows: tuple[int, int, int], z: tuple[int, ...]) -> list[Block]:
        """The blocks of one slab (``rows`` = start, stop, grid index along dim 0) and the rank owning each."""
        grid = self.plan.grids[image]
        crop = self.plan.crop_box(image, z)
        runs = [self.plan.segments(image, d, a, b, z[d]) for d, (a, b) in enumerate(crop) if d > 0]
        out = []
        for combo in itertools.product(*runs):
            first = rows[2] * grid.strides[0] + sum(i * grid.strides[d + 1] for d, (_, _, i) in enumerate(combo))
            owner = int(self.plan.owner(first + self.plan.offsets[image], self.rank_bounds))
            out.append((((rows[0], rows[1]), *((a, b) for a, b, _ in combo)), owner))
        return out

    def slabs(self, image: int, z: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        """Runs of output rows with one lowest covering window row, cut to at most ``SLAB_VOXELS`` voxels."""
        crop = self.plan.crop_box(image, z)
        step = max(1, SLAB_VOXELS // max(math.prod(b - a for a, b in crop[1:]), 1))
        for a, b, i in self.plan.segments(image, 0, *crop[0], z[0]):
            for y in range(a, b, step):
                yield y, min(y + step, b), i

    def view(self, image: int, out: torch.Tensor, z: tuple[int, ...]) -> Callable[[Box], torch.Tensor]:
        """``view(box)``: the part of ``out`` (image ``image``'s ``(C, *size)`` output, cropped) under ``box``."""
        crop = self.plan.crop_box(image, z)

        def view(box):
            return out[(slice(None), *(slice(a - c, b - c) for (a, b), (c, _) in zip(box, crop, strict=True)))]
        return view

    def flat_blocks(self, blocks: list[Block], canvas: Canvas | None, owner: int, channels: int) -> torch.Tensor:
        """``owner``'s blended blocks of one slab, flattened and concatenated, divided straight into one buffer."""
        boxes = [box for box, o in blocks if o == owner]
        sizes = [math.prod(b - a for a, b in box) * channels for box in boxes]
        flat = torch.empty(sum(sizes), dtype=self.acc_dtype)
        offset = 0
        for box, n in zip(boxes, sizes, strict=True):
            canvas.blended(box, out=flat[offset:offset + n].view(channels, *(b - a for a, b in box)))
            offset += n
        EXCHANGE_STATS["owned"] = EXCHANGE_STATS.get("owned", 0) + flat.numel() * flat.element_size()
        return flat

    @staticmethod
    def place(image: int, parts: torch.Tensor, boxes: list[Box], view: Callable[[Box], torch.Tensor]) -> None:
        """Copy ``parts`` (blocks flattened and concatenated, as :meth:`flat_blocks` made them) into ``boxes``."""
        offset = 0
        for box in boxes:
            target = view(box)
            target.copy_(parts[offset:offset + target.numel()].reshape(target.shape))
            offset += target.numel()
        if offset != parts.numel():
            raise RuntimeError(f"image {image}: ranks sent {parts.numel()} values for {offset}; "
                               "every voxel must have exactly one owner")

