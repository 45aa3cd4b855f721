"""The last phase of ``sliding_window``: rank 0 assembles the blended output (inside each rank; call on all ranks).

Rank 0 fills its output slab by slab (:class:`~multigpu.infer.layout.OutputLayout`): it divides its own blocks
straight into the output, and receives the blocks of ranks 1..last-1 with one ``gather`` per slab (the last
rank's came point to point meanwhile: :mod:`multigpu.infer.exchange`). So its memory holds the output plus its
own canvas and one slab per rank, never a number of windows. One process with one image whose canvas is its
whole output divides that canvas in place instead (:func:`whole_canvas`), as MONAI does.
"""

from __future__ import annotations

import torch

from multigpu.infer.evaluate import OutputSpec, RankWindows
from multigpu.infer.exchange import WindowExchange
from multigpu.infer.layout import OutputLayout
from multigpu.infer.stats import timed_phase
from multigpu.runtime import collectives

__all__ = ["allocate_outputs", "assemble_image", "whole_canvas"]


def assemble_image(rank_windows: RankWindows, layout: OutputLayout, exchange: WindowExchange, image: int,
                   out: torch.Tensor | None) -> None:
    """Fill ``out`` (rank 0's ``(C, *size)`` view of image ``image``'s output) from every rank, slab by slab.

    A slab is cut into blocks, each owned by one rank (:meth:`OutputLayout.blocks`); rank 0 copies its own blocks,
    and receives the blocks of ranks 1..last-1, flattened and concatenated in rank order then block order,
    with one ``gather`` (none where they own nothing). The last rank's blocks are already there
    (``send_owned`` / the receiver thread).
    """
    z, channels = rank_windows.spec.scale, rank_windows.spec.channels
    view = layout.view(image, out, z) if out is not None else None
    canvas = rank_windows.canvases.get(image)
    for rows in layout.slabs(image, z):
        blocks = layout.blocks(image, rows, z)
        if rank_windows.rank == 0:
            with timed_phase("assemble"):
                for box, owner in blocks:
                    if owner == 0 and not exchange.sends_early(0):  # (in a group of one, rank 0's came as the last's)
                        canvas.blended(box, out=view(box))  # divided straight into the output
        if any(owner > 0 and not exchange.sends_early(owner) for _, owner in blocks):  # the same answer on every rank
            with timed_phase("gather"):  # rank 0 receives ranks 1..last-1's blocks, in rank order then block order
                if rank_windows.rank != 0 and not exchange.sends_early(rank_windows.rank):
                    sent = layout.flat_blocks(blocks, canvas, rank_windows.rank, channels)
                else:
                    sent = torch.empty(0, dtype=rank_windows.acc_dtype)
                parts = collectives.gather(sent, dst=0)
                if parts is not None:
                    wanted = sorted((b for b in blocks if b[1] != 0 and not exchange.sends_early(b[1])),
                                    key=lambda b: b[1])  # stable
                    layout.place(image, parts, [box for box, _ in wanted], view)
    rank_windows.canvases.pop(image, None)


def whole_canvas(rank_windows: RankWindows, groups: list[int] | None) -> torch.Tensor | None:
    """One process and one image whose canvas is exactly its output (no padding to crop): the sums divided in place
    and returned (on the host), as MONAI does; no second image-sized buffer. None in every other case."""
    if rank_windows.distributed or groups is not None or len(rank_windows.images) != 1 or rank_windows.spec is None:
        return None
    canvas = rank_windows.canvases.get(0)
    if canvas is None or canvas.box != rank_windows.plan.crop_box(0, rank_windows.spec.scale):
        return None
    rank_windows.canvases.pop(0)
    return canvas.acc.div_(canvas.weight).to("cpu")  # the same quotient as blended(); on a GPU, one copy back


def allocate_outputs(images: list[torch.Tensor], groups: list[int] | None, spec: OutputSpec) -> tuple:
    """Rank 0's output: ``(result, views)``, the tensors returned (one, or one per input tensor: ``groups`` holds
    their batch sizes) and a ``(C_out, *size)`` view per image to fill."""

    def size(image: int) -> tuple[int, ...]:
        return tuple(s * z for s, z in zip(images[image].shape[1:], spec.scale, strict=True))

    if groups is None:
        out = torch.empty((len(images), spec.channels, *size(0)), dtype=spec.dtype)
        return out, list(out)
    result, views, i = [], [], 0
    for n in groups:
        t = torch.empty((n, spec.channels, *(size(i) if n else ())), dtype=spec.dtype)
        result.append(t)
        views.extend(t)
        i += n
    return result, views
