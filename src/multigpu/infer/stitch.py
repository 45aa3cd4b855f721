"""Blending window outputs back into an image (pure tensor math, no communication).

Runs inside each rank. Each window's output ``y`` is multiplied by a weight map
``w`` (all ones for ``blend="constant"``; a Gaussian that fades towards the
window's edges for ``"gaussian"``) and added into a :class:`Canvas`, which also
adds up the weights; the blended value is ``sum(w * y) / sum(w)``. These are
MONAI's weights and operations (``compute_importance_map``, nearest-exact
resizing of the weights for a model that changes the spatial size), in the same
float32 arithmetic, so a single process reproduces ``sliding_window_inference``.

A canvas covers only a box of the padded output (the box a rank's windows
touch), so a rank never allocates the whole image unless its windows cover it.
Additions into one voxel happen in the order of ``add`` calls; ``sliding_window``
calls it in window order, which is what makes the result independent of the number
of ranks (see ``sliding``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from multigpu.errors import ConfigError

__all__ = ["BLENDS", "Canvas", "crop_bounds", "crop_mask", "importance_map"]


def crop_bounds(starts: Sequence[int], roi: int, index: int) -> tuple[int, int]:
    """The part of window ``index`` (of windows at ``starts`` along one dim) that ``blend="crop"`` keeps, in the
    window's own coordinates: from the middle of its overlap with the previous window to the middle of its overlap
    with the next one (its own edge where there is no neighbour; a voxel exactly in the middle goes to the later
    window). Over all windows these parts tile the axis exactly once: every voxel takes one window's output."""
    start = starts[index]
    lo = (starts[index - 1] + roi + start) // 2 if index > 0 else start
    hi = (start + roi + starts[index + 1]) // 2 if index + 1 < len(starts) else start + roi
    return lo - start, hi - start

BLENDS = ("constant", "gaussian", "crop")
"""Plain mean, a Gaussian fading to the window edges, or each window's inner part only (``crop_mask``)."""


def importance_map(
    roi: Sequence[int],
    blend: str = "constant",
    *,
    sigma_scale: float | Sequence[float] = 0.125,
    out_size: Sequence[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Weight of each voxel of a window's output, shape ``out_size`` (default ``roi``).

    ``"gaussian"``: separable, sigma = ``sigma_scale * roi`` per dim, centred,
    clamped below at max(its minimum, 1e-3) so edge voxels still count (MONAI's rule).
    For a model whose output is ``scale`` times larger, the map is computed at
    ``roi`` and resized to ``out_size`` by nearest-exact interpolation, as MONAI does.
    """
    roi = tuple(int(r) for r in roi)
    if blend in ("constant", "crop"):  # crop: ones, masked per window by crop_mask
        weights = torch.ones(roi, dtype=torch.float)
    elif blend == "gaussian":
        scales = (sigma_scale,) * len(roi) if isinstance(sigma_scale, (int, float)) else tuple(sigma_scale)
        weights = None
        for i, (n, s) in enumerate(zip(roi, scales, strict=True)):
            sigma = n * s
            x = torch.arange(start=-(n - 1) / 2.0, end=(n - 1) / 2.0 + 1, dtype=torch.float)
            x = torch.exp(x**2 / (-2 * sigma**2))
            weights = x if i == 0 else weights.unsqueeze(-1) * x[(None,) * i]
    else:
        raise ConfigError(f"blend={blend!r} is not one of {', '.join(BLENDS)}")
    # floor = max(min, 1e-3) kept as a float32 tensor: the same clamp as with the Python number, and no value
    # is read back (fake-CUDA tests run this with tensors that hold none)
    floor = torch.clamp(torch.min(weights), min=torch.tensor(1e-3, dtype=torch.float))
    weights = torch.clamp_(weights.to(torch.float), min=floor).to(dtype)
    if out_size is not None and tuple(out_size) != roi:
        weights = F.interpolate(weights[None, None], size=tuple(out_size), mode="nearest-exact")[0, 0]
    return weights


def crop_mask(weights: torch.Tensor, starts: Sequence[Sequence[int]], roi: Sequence[int], grid_index: Sequence[int],
              scale: Sequence[int]) -> torch.Tensor:
    """``weights`` (a window's output-sized ones) zeroed outside the part :func:`crop_bounds` keeps, per dim."""
    mask = weights.clone()
    for d, (st, r, i, z) in enumerate(zip(starts, roi, grid_index, scale, strict=True)):
        lo, hi = crop_bounds(st, r, i)
        index = [slice(None)] * mask.dim()
        index[d] = slice(0, lo * z)
        mask[tuple(index)] = 0
        index[d] = slice(hi * z, None)
        mask[tuple(index)] = 0
    return mask


class Canvas:
    """Weighted sums of window outputs over one box of one image's padded output.

    Args:
        channels: Output channels of the model.
        box: ``(start, stop)`` per spatial dim, in padded output coordinates.
        dtype: Accumulation dtype (float32 unless the input is float64).
        device: Where the sums live: the host, or the GPU the windows ran on when they fit there. An output
            from elsewhere (another rank's window, received on the host) is moved here first.
    """

    def __init__(self, channels: int, box: Sequence[tuple[int, int]], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.origin = tuple(int(a) for a, _ in box)
        self.size = tuple(int(b - a) for a, b in box)
        self.acc = torch.zeros((channels, *self.size), dtype=dtype, device=device)
        self.weight = torch.zeros((1, *self.size), dtype=dtype, device=device)

    @property
    def box(self) -> tuple[tuple[int, int], ...]:
        return tuple((o, o + s) for o, s in zip(self.origin, self.size, strict=True))

    def _overlap(self, start: Sequence[int], size: Sequence[int]) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
        mine, theirs = [], []
        for o, n, s, m in zip(self.origin, self.size, start, size, strict=True):
            lo, hi = max(o, s), min(o + n, s + m)
            if lo >= hi:
                return None
            mine.append(slice(lo - o, hi - o))
            theirs.append(slice(lo - s, hi - s))
        return tuple(mine), tuple(theirs)

    def add(self, output: torch.Tensor, weights: torch.Tensor, start: Sequence[int], *, weighted: bool = False) -> None:
        """Add ``weights * output`` (output ``(C, *out_roi)``) placed at ``start``; parts outside the box are dropped.
        ``weighted``: ``output`` is that product already (made for a whole batch at once, as MONAI makes it)."""
        spans = self._overlap(start, output.shape[1:])
        if spans is None:
            return
        mine, theirs = spans
        output, weights = output.to(self.acc.device), weights.to(self.acc.device)
        # the product over the whole window first, then the add: MONAI's order of float operations
        product = output if weighted else output * weights
        self.acc[(slice(None), *mine)] += product[(slice(None), *theirs)]
        self.weight[(slice(None), *mine)] += weights[None][(slice(None), *theirs)]

    def blended(self, box: Sequence[tuple[int, int]], out: torch.Tensor | None = None) -> torch.Tensor:
        """``sum(w * y) / sum(w)`` over ``box`` (which must lie inside this canvas), shape ``(C, *box size)``.

        With ``out`` (a tensor, or a view, of that shape) the quotient is written there: no temporary when it
        lives with the sums; from a GPU canvas into a host ``out`` the quotient is made on the GPU and copied.
        """
        index = tuple(slice(a - o, b - o) for (a, b), o in zip(box, self.origin, strict=True))
        acc, weight = self.acc[(slice(None), *index)], self.weight[(slice(None), *index)]
        if out is not None and out.device != acc.device:
            return out.copy_(torch.div(acc, weight))
        return torch.div(acc, weight, out=out)
