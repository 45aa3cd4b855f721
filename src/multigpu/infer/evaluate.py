"""The first phase of ``sliding_window``: this rank's windows, cut, run through the model and blended into its
canvases (inside each rank; nothing here communicates).

A rank's windows are its contiguous share of the window batches (``WindowPlan.rank_bounds``), so they form a
band of the image and its canvases (:class:`~multigpu.infer.stitch.Canvas`) cover only the box they touch.
Each window's weighted output is added there in window order; a window output another rank's voxels need is
handed to ``route(owner, index, output)`` (:meth:`multigpu.infer.exchange.WindowExchange.route`).

On a GPU, windows are cut and stitched there: the image goes to the GPU once (when it fits in a quarter of the
free memory), windows are cut from it there, and the canvases live there too (when this rank's fit in a
quarter of what is then free). Where either does not fit, it stays on the host: each batch is copied over from
pinned memory, and the host stitches one batch behind the GPU (batch k's output is copied back without
blocking and added after batch k+1's model call is queued, waiting only for batch k's copy, a CUDA event). The
stitching's float operations are the same on either side, so where it happens changes no bit.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from multigpu.errors import ConfigError
from multigpu.infer.stats import timed_phase
from multigpu.infer.stitch import Canvas, crop_mask, importance_map
from multigpu.infer.windows import Window, WindowPlan
from multigpu.monitor import StepMeter
from multigpu.runtime import group

__all__ = ["PAD_MODES", "PRECISIONS", "OutputSpec", "PackedModel", "RankWindows", "Route"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
"""``precision`` -> the autocast dtype around the model (None: no autocast)."""
PAD_MODES = ("constant", "reflect", "replicate", "circular")
"""How an image smaller than the roi is padded up to it (``torch.nn.functional.pad``'s modes)."""

Route = Callable[[int, int, torch.Tensor], None]
"""``route(owner, index, output)``: window ``index``'s weighted output, which rank ``owner``'s voxels need."""


@dataclass(frozen=True)
class OutputSpec:
    """What the model makes of one window: the same on every rank once they agree
    (:meth:`~multigpu.infer.exchange.WindowExchange.agree_on_output`)."""

    channels: int
    """Output channels."""
    scale: tuple[int, ...]
    """The output window's size over the roi's, per spatial dim (1: the same size; 2: x2 super-resolution)."""
    dtype: torch.dtype
    """The dtype the outputs are added up in (float32; float64 for float64 input)."""


def _rank_and_size() -> tuple[int, int, bool]:
    """``(rank, world_size, whether a process group exists)``: the test harness's group of one has one."""
    if not group.is_initialized():
        return 0, 1, False
    env = group.get_env()
    return env.rank, env.world_size, env.backend != "none"


def _model_device(model, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    params = getattr(model, "parameters", None)
    if params is not None:
        first = next(iter(params()), None)
        if first is not None:
            return first.device
    return group.current_device()


class RankWindows:
    """This rank's windows (its contiguous share of the batches), run through the model and added in window order
    into canvases over the box they touch. Nothing here communicates: each window output another rank's voxels
    need is handed to ``route(owner, index, output)``."""

    def __init__(self, images, model, roi, overlap, batch_size, blend, precision, pad_mode, *,
                 sigma_scale, cval, device, model_kwargs=None):
        self.images, self.model, self.model_kwargs = images, model, dict(model_kwargs or {})
        self.roi, self.blend, self.sigma_scale = roi, blend, sigma_scale
        self.batch_size, self.pad_mode, self.cval = batch_size, pad_mode, cval
        self.autocast_dtype = PRECISIONS[precision]
        self.device = _model_device(model, device)
        self.plan = WindowPlan([im.shape[1:] for im in images], roi, overlap)
        self.rank, self.world_size, self.distributed = _rank_and_size()
        self.rank_bounds = self.plan.rank_bounds(batch_size, self.world_size)
        """Every rank's windows, ``(start, stop)`` in window order."""
        self.start, self.stop = self.rank_bounds[self.rank]
        """This rank's windows: ``start`` to ``stop - 1``."""
        in_dtype = images[0].dtype
        self.acc_dtype = torch.float64 if in_dtype == torch.float64 else torch.float32
        self.spec: OutputSpec | None = None
        """The model's output per window (None until a batch has run, or the ranks agreed)."""
        self.weights: torch.Tensor | None = None
        self.canvases: dict[int, Canvas] = {}
        """Image index -> this rank's canvas over the box its windows touch there."""
        self.stitch_device = torch.device("cpu")  # the GPU when this rank's canvases fit there (set_output_spec)
        self._padded: tuple[int, torch.Tensor] | None = None
        self._copies_to_host: list[tuple[list[int], int, torch.Tensor, torch.device]] = []
        """Window outputs other ranks need, on their way to the host (``_stitch``), routed after the loop."""
        self._product: torch.Tensor | None = None
        """One batch's weighted outputs, reused from batch to batch (``_weighted``): a fresh one per batch cost an
        allocation of the whole batch's output and its page faults. Whatever keeps a window's product past its
        batch copies it (``route``)."""

    def _fits_on_device(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in a quarter of the GPU's free memory (the model's activations need the rest)."""
        if self.device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        return nbytes <= free // 4

    def num_batches(self) -> int:
        return -(-(self.stop - self.start) // self.batch_size)

    # ------------------------------------------------------------------ cutting windows
    def _padded_image(self, index: int) -> torch.Tensor:
        """Image ``index``, padded up to the roi where it is smaller (the last one is kept)."""
        if self._padded is not None and self._padded[0] == index:
            return self._padded[1]
        image = self.images[index]
        if image.device.type == "cpu" and self._fits_on_device(image.numel() * image.element_size() * 2):
            image = image.to(self.device)  # once: windows are then cut on the GPU, no copy per batch
        pad = self.plan.grids[index].pad
        if any(a or b for a, b in pad):
            flat = [w for a, b in reversed(pad) for w in (a, b)]
            x = image if image.is_floating_point() else image.float()
            try:
                if self.pad_mode == "constant":
                    image = F.pad(x, flat, mode="constant", value=self.cval)
                else:
                    image = F.pad(x[None], flat, mode=self.pad_mode)[0]
            except (RuntimeError, NotImplementedError) as exc:
                raise ConfigError(f"pad_mode={self.pad_mode!r} cannot pad image {index} of size "
                                  f"{tuple(self.images[index].shape[1:])} up to roi {list(self.roi)}: "
                                  f"{str(exc).splitlines()[0]}; use pad_mode='constant' or 'replicate'") from None
        self._padded = (index, image)
        return image

    def _batches(self) -> Iterator[tuple[list[Window], torch.Tensor]]:
        """This rank's window batches, cut from the image where it lies (the host, or the GPU: ``_padded_image``)."""
        for lo in range(self.start, self.stop, self.batch_size):
            windows = list(self.plan.windows(lo, min(lo + self.batch_size, self.stop)))
            crops = []
            for w in windows:
                index = (slice(None), *(slice(s, s + r) for s, r in zip(w.start, self.roi, strict=True)))
                crops.append(self._padded_image(w.image)[index])
            x = torch.stack(crops)
            yield windows, (x if x.is_floating_point() else x.float())

    def _batch_to_device(self, item):
        if item is None or self.device.type == "cpu":
            return item
        windows, x = item
        if x.device.type != "cpu":  # cut from an image already on a GPU: nothing to pin (torch refuses to)
            return windows, x.to(self.device, non_blocking=True)
        # pinned memory + non_blocking: the copy overlaps the model still running on the previous batch
        return windows, x.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ the model
    def _autocast(self):
        """One autocast for the whole pass (``bf16``/``fp16``; nothing under fp32): entered per batch, each exit
        would drop autocast's low-precision copies of the weights and cast them all again."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model on one batch, gradients off but outside inference mode: under ``inference_mode`` autocast
        keeps no copy of a cast weight (torch skips its cache there), so every batch would cast every weight again
        (a kernel each on a GPU); here each is cast once per pass. The output is a plain tensor (no grad)."""
        with torch.inference_mode(False), torch.no_grad():
            return self.model(x, **self.model_kwargs)

    def _output_spec(self, out, x: torch.Tensor) -> OutputSpec:
        """What the model made of batch ``x``; one-line ConfigError for an output sliding_window cannot stitch."""
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"the model returned {type(out).__name__}; sliding_window needs a tensor (N, C, *spatial)")
        if out.dim() != x.dim() or out.shape[0] != x.shape[0]:
            raise ConfigError(f"the model turned a window batch {tuple(x.shape)} into {tuple(out.shape)}; "
                              f"it must return ({x.shape[0]}, C_out, *spatial) with the same number of dims")
        scale = []
        for o, r in zip(out.shape[2:], self.roi, strict=True):
            if o % r:
                raise ConfigError(f"the model's output window {tuple(out.shape[2:])} is not a whole multiple of "
                                  f"roi {list(self.roi)}; only integer scale factors are supported")
            scale.append(o // r)
        return OutputSpec(int(out.shape[1]), tuple(scale), self.acc_dtype)

    def set_output_spec(self, spec: OutputSpec) -> None:
        """Take the model's output per window: the blending weights for it, and where this rank's canvases go
        (the GPU when they fit there)."""
        if self.spec is not None and self.spec != spec:
            raise ConfigError(f"the model's output changed between batches: {self.spec} then {spec}")
        self.spec = spec
        out_size = [r * z for r, z in zip(self.roi, spec.scale, strict=True)]
        # this rank's canvases: the sums and the weights over the box its windows touch, in every image they touch
        canvas_bytes = sum((spec.channels + 1) * math.prod(b - a for a, b in self.plan.output_box(
            image, self.start, self.stop, spec.scale)) for image in self.plan.images_in(self.start, self.stop))
        if self._fits_on_device(canvas_bytes * self.acc_dtype.itemsize):
            self.stitch_device = self.device
        self.weights = importance_map(self.roi, self.blend, sigma_scale=self.sigma_scale, out_size=out_size,
                                      dtype=self.acc_dtype).to(self.stitch_device)

    # ------------------------------------------------------------------ blending into the canvases
    def _canvas(self, image: int) -> Canvas:
        if image not in self.canvases:
            box = self.plan.output_box(image, self.start, self.stop, self.spec.scale)
            self.canvases[image] = Canvas(self.spec.channels, box, self.acc_dtype, self.stitch_device)
        return self.canvases[image]

    def _weights_of(self, w: Window) -> torch.Tensor:
        """The window's weight map: the same for every window, except under ``blend="crop"``."""
        if self.blend != "crop":
            return self.weights
        grid = self.plan.grids[w.image]
        return crop_mask(self.weights, grid.starts, self.roi, grid.grid_index(w.local), self.spec.scale)

    def add_received(self, index: int, y: torch.Tensor) -> None:
        """Add the weighted output of window ``index``, sent by another rank, into the canvas of its image (this
        rank owns voxels there, so its own windows made that canvas)."""
        w = self.plan.window(index)
        start = tuple(s * f for s, f in zip(w.start, self.spec.scale, strict=True))
        self.canvases[w.image].add(y, self._weights_of(w), start, weighted=True)

    def _weighted(self, windows: list[Window], out: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Each window's output times its weights: one product for the batch when every window has the same
        weights (MONAI's order: the product, then the adds), else window by window (``blend="crop"``)."""
        if self.blend != "crop":
            weights = self.weights.to(out.device)
            buf = self._product
            if (buf is None or buf.shape[1:] != out.shape[1:] or buf.shape[0] < out.shape[0] or buf.device != out.device
                    or buf.dtype != torch.result_type(out, weights)):
                buf = self._product = torch.empty(out.shape, dtype=torch.result_type(out, weights), device=out.device)
            return torch.mul(out, weights, out=buf[:out.shape[0]])  # the same product, bit for bit, as out * weights
        return [y * self._weights_of(w).to(y.device) for w, y in zip(windows, out, strict=True)]

    def _stitch(self, windows: list[Window], out: torch.Tensor, route: Route) -> None:
        """Add each window's weighted output in window order, and hand ``route`` the ones other ranks' voxels need
        (weighted: the receiver adds them as they are). The exchange sends host tensors (over gloo): a window on a
        GPU starts its copy to the host here without blocking, and is routed after the model loop
        (:meth:`_route_copied`), so the loop never waits for the GPU at a rank boundary."""
        z = self.spec.scale
        for w, y in zip(windows, self._weighted(windows, out), strict=True):
            start = tuple(s * f for s, f in zip(w.start, z, strict=True))
            self._canvas(w.image).add(y, self._weights_of(w), start, weighted=True)
            if self.distributed:
                owners = np.unique(self.plan.owner(self.plan.first_windows_inside(w.image, w.local, z),
                                                   self.rank_bounds))
                others = [int(r) for r in owners if r != self.rank]
                if not others:
                    continue
                if y.device.type == "cpu":
                    for r in others:
                        route(r, w.index, y)
                else:  # into pinned memory (torch allocates it so), behind this batch's kernels
                    self._copies_to_host.append((others, w.index, y.to("cpu", non_blocking=True), y.device))

    def _route_copied(self, route: Route) -> None:
        """After the model loop: one wait for the copies started by :meth:`_stitch` (an event on each copy's
        stream), then every such window to ``route``, in window order."""
        if not self._copies_to_host:
            return
        for device in {d for *_, d in self._copies_to_host}:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # the copies' stream: the output's device's
            ready.synchronize()
        for others, index, host, _ in self._copies_to_host:
            for r in others:
                route(r, index, host)
        self._copies_to_host = []

    def _start_copy_to_host(self, out: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying a batch's output to the host: ``(host tensor, CUDA event or None)``.

        On CUDA the copy goes into pinned memory behind the model's kernels and nothing waits here;
        the event tells when it has landed. Elsewhere the copy is done on return.
        """
        y = out.detach()
        if self.stitch_device.type == "cuda":  # stitched where it is: nothing to copy, nothing to wait for
            return y.to(self.acc_dtype), None
        if y.device.type != "cuda":
            return y.to("cpu", self.acc_dtype), None
        host = y.to("cpu", non_blocking=True)  # pinned (torch allocates it so for a non-blocking copy to the host)
        ready = torch.cuda.Event()
        # on the stream the copy ran on: the output's device's, which need not be the current device
        ready.record(torch.cuda.current_stream(y.device))
        return host, ready

    def _stitch_when_ready(self, windows: list[Window], host: torch.Tensor, ready, route: Route) -> None:
        if ready is not None:
            ready.synchronize()  # this batch's copy only: the next batch's model is already queued behind it
        self._stitch(windows, host.to(self.acc_dtype), route)

    # ------------------------------------------------------------------ the loop
    def evaluate(self, meter: StepMeter, route: Route) -> None:
        """Run the model over this rank's batches and stitch the outputs, one batch behind the model.

        Batch k is stitched after batch k+1's model call is queued: on a GPU with host canvases the model
        keeps running while the host adds batch k into the canvas (with canvases on the GPU the adds are
        only queued behind it), and no step waits for the whole device. Stitching stays in window order,
        so the output is the same bits.
        """
        with self._autocast():  # once: its cast weights are kept from one batch to the next
            self._model_loop(meter, route)
        with timed_phase("blend"):
            self._route_copied(route)

    def _model_loop(self, meter: StepMeter, route: Route) -> None:
        batches = iter(self._batches())
        with timed_phase("cut"):
            current = self._batch_to_device(next(batches, None))
        behind = None  # (windows, host output, event) of the batch whose model call came before
        while current is not None:
            windows, x = current
            with meter.step(items=len(windows)):
                with timed_phase("model"):  # on a GPU: the time to queue it, the wait shows in "blend"
                    out = self._forward(x)
                with timed_phase("cut"):  # queued on a GPU; the next batch is cut and copied meanwhile
                    current = self._batch_to_device(next(batches, None))
                spec = self._output_spec(out, x)
                if self.spec is None or spec != self.spec:
                    self.set_output_spec(spec)
                queued = (windows, *self._start_copy_to_host(out))
                with timed_phase("blend"):
                    if behind is not None:
                        self._stitch_when_ready(*behind, route)
                    behind = queued
                    if current is None:  # the last batch: nothing left to queue before it
                        self._stitch_when_ready(*behind, route)


class PackedModel:
    """The model, its tuple/list/dict outputs concatenated along channels (one stitch), split back after
    (:meth:`unpack`). A model that returns one tensor is called as it is."""

    def __init__(self, model):
        self.model = model
        self.structure: tuple[type, list, list[int]] | None = None  # (kind, keys, channels per part)

    def parameters(self):
        params = getattr(self.model, "parameters", None)
        return params() if params is not None else iter(())

    def __call__(self, x, **kwargs):
        out = self.model(x, **kwargs)
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, dict):
            keys, parts = list(out), list(out.values())
        elif isinstance(out, (tuple, list)):
            keys, parts = list(range(len(out))), list(out)
        else:
            return out  # RankWindows._output_spec names what came back
        if not parts or not all(isinstance(p, torch.Tensor) and p.dim() == x.dim() for p in parts):
            raise ConfigError("the model returned a tuple/list/dict whose parts are not all (N, C, *spatial) tensors")
        if len({tuple(p.shape[2:]) for p in parts}) != 1:
            raise ConfigError(f"the model's outputs have different spatial sizes {[tuple(p.shape) for p in parts]}; "
                              "sliding_window stitches outputs of one scale")
        self.structure = (type(out), keys, [int(p.shape[1]) for p in parts])
        return torch.cat([p.float() if p.dtype != parts[0].dtype else p for p in parts], dim=1)

    def unpack(self, result):
        """The stitched output (a tensor, or a list of them) in the model's own structure again."""
        if self.structure is None:
            return result
        if isinstance(result, list):
            return [self.unpack(r) for r in result]
        kind, keys, channels = self.structure
        parts = torch.split(result, channels, dim=1)
        if kind is dict or issubclass(kind, dict):
            return dict(zip(keys, parts, strict=True))
        return kind(parts) if kind in (tuple, list) else tuple(parts)
