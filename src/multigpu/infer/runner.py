"""Distributed sliding-window inference: ``sliding_window`` (runs inside each rank; call on all ranks).

How the work and the output are split (windows.py numbers the windows):

1. **Windows, exactly once.** The windows of all images, numbered in order, are
   cut into batches of ``batch_size``; the batches are sharded like ``mg.shard``
   (contiguous, sizes differ by at most one batch). A rank evaluates only its
   windows, so its windows form a band of the image and it allocates a canvas
   (``stitch.Canvas``) only over the box they touch.
2. **Owners, for a result independent of the split.** Overlapping window
   outputs are added in window order (as one process, and MONAI, would). Each
   output voxel belongs to the rank holding its *lowest* covering window; that
   rank has already added its own windows in order and needs only the outputs
   of the later windows (of later ranks) that touch its voxels: a band about
   one window row deep. Those are sent to it once (``gather`` per destination),
   and it adds them in window order.
3. **Rank 0 assembles** the blended voxels slab by slab (``gather`` of each
   rank's owned voxels in a slab), so its memory holds the output plus its own
   canvas and one slab per rank, never a number of windows.
4. **The last rank goes first.** Its voxels need no other rank's windows (every
   window covering them is its own), so as soon as it has evaluated it sends
   rank 0 its blended voxels, slab by slab, point to point; and it sends each
   window that an earlier rank's voxels need right after its windows (on a
   GPU their copies to the host start without blocking in the model loop and
   the host waits for them once, after it). A
   receiver thread on ranks 0..last-1 takes these while they still evaluate
   their own windows, so on 2 ranks nothing is exchanged after rank 0's last
   window but the wait for that thread. Rank 0 has the most windows (shards
   give lower ranks the extra batch), so the exchange leaves its critical path.
   These messages are CPU tensors over gloo (``group.exchange_group``: a group
   beside NCCL on GPU jobs): a receive over NCCL would make the CUDA stream the
   main thread's kernels share wait until the last rank sends.
5. **On a GPU, windows are cut and stitched there.** The image goes to the GPU
   once (when it fits in a quarter of the free memory), windows are cut from
   it there, and the canvases live there too (when this rank's fit in a
   quarter of what is then free): the host only queues kernels, and the
   blended voxels come back once, at assembly. Where either does not fit, it
   stays on the host: each batch is copied over from pinned memory, and the
   host stitches one batch behind the GPU (batch k's output is copied back
   without blocking and added after batch k+1's model call is queued, waiting
   only for batch k's copy, a CUDA event). The stitching's float operations
   are the same on either side, so where it happens changes no bit.

Guarantee: the output on any number of ranks is bitwise identical to the output
of one process, for any model whose output for a window is a deterministic
function of its batch (batches are the same on any number of ranks) and of the
threads it runs on: a kernel may split its sums over threads (oneDNN's CPU
convolutions do on some CPUs, differing by ~1e-6), and a rank gets
``cores // ranks per node`` threads unless ``--threads`` says otherwise. So give
every run the same ``--threads`` (``multigpu verify`` does) where that matters.
With ``precision="fp32"`` a single process performs MONAI's float operations in
MONAI's order, so it matches ``monai.inferers.sliding_window_inference`` run with
as many threads (``torch.get_num_threads()``) on the same machine: bitwise when the
model's kernels are batch-invariant, else to float tolerance.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from multigpu.errors import ConfigError
from multigpu.infer.stitch import BLENDS, Canvas, crop_mask, importance_map
from multigpu.infer.windows import Window, WindowPlan, as_tuple
from multigpu.monitor import StepMeter
from multigpu.runtime import collectives, group

__all__ = ["PAD_MODES", "PRECISIONS", "sliding_window", "sliding_window_inference"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PAD_MODES = ("constant", "reflect", "replicate", "circular")
_SLAB_VOXELS = 1 << 22  # voxels per assembly slab: bounds rank 0's receive buffers (x world_size x channels)
EXCHANGE_STATS: dict[str, int] = {}
"""Bytes this rank sent in the last ``sliding_window`` call: ``spill`` (window outputs), ``owned`` (voxels to rank 0)."""
PHASE_SECONDS: dict[str, float] = {}
"""Wall seconds this rank spent per phase of the last ``sliding_window`` call: ``cut`` (windows cut and stacked),
``model``, ``blend`` (window outputs added into the canvas), ``idle`` (waiting for the slowest rank to finish its
windows), ``spill`` (the exchange of window outputs), ``assemble`` (rank 0 writing its own voxels into the
output), ``gather`` (the owned voxels sent to rank 0 and placed there; includes waiting). For benchmarks."""


@contextlib.contextmanager
def _phase(name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        PHASE_SECONDS[name] = PHASE_SECONDS.get(name, 0.0) + time.perf_counter() - start


@dataclass(frozen=True)
class _OutMeta:
    channels: int
    scale: tuple[int, ...]
    dtype: torch.dtype


def _coords() -> tuple[int, int, bool]:
    """``(rank, world_size, whether a process group exists)``: the test harness's group of one has one."""
    if not group.is_initialized():
        return 0, 1, False
    env = group.get_env()
    return env.rank, env.world_size, env.backend != "none"


def _flatten(inputs) -> tuple[list[torch.Tensor], list[int] | None]:
    """Images as a list of ``(C, *spatial)`` tensors, and the batch sizes to regroup them (None: one tensor)."""
    if isinstance(inputs, torch.Tensor):
        groups, items = None, [inputs]
    elif isinstance(inputs, Sequence) and inputs and all(isinstance(x, torch.Tensor) for x in inputs):
        items = list(inputs)
        groups = [x.shape[0] if x.dim() else 0 for x in items]
    else:
        raise ConfigError("inputs must be a tensor (N, C, *spatial) or a non-empty list of such tensors")
    ndims = {x.dim() for x in items}
    if len(ndims) != 1 or next(iter(ndims)) not in (4, 5):
        raise ConfigError(f"inputs must be (N, C, H, W) or (N, C, D, H, W) tensors, got shapes {[tuple(x.shape) for x in items]}")
    chans = {x.shape[1] for x in items}
    if len(chans) != 1:
        raise ConfigError(f"every image needs the same number of channels, got {sorted(chans)}")
    images = [img for x in items for img in x]
    if not images:
        raise ConfigError("inputs hold no image (N = 0)")
    return images, groups


def _check_args(roi, overlap, batch_size, blend, precision, pad_mode, ndim) -> tuple[tuple[int, ...], tuple[float, ...]]:
    roi = tuple(int(r) for r in as_tuple(roi, ndim, "roi"))
    overlap = tuple(float(o) for o in as_tuple(overlap, ndim, "overlap"))
    if any(r < 1 for r in roi):
        raise ConfigError(f"roi={list(roi)} must be >= 1 in every dim")
    if any(not 0 <= o < 1 for o in overlap):
        raise ConfigError(f"overlap={list(overlap)} must be in [0, 1) in every dim")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1")
    if blend not in BLENDS:
        raise ConfigError(f"blend={blend!r} is not one of {', '.join(BLENDS)}")
    if precision not in PRECISIONS:
        raise ConfigError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if pad_mode not in PAD_MODES:
        raise ConfigError(f"pad_mode={pad_mode!r} is not one of {', '.join(PAD_MODES)}")
    return roi, overlap


def _model_device(model, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    params = getattr(model, "parameters", None)
    if params is not None:
        first = next(iter(params()), None)
        if first is not None:
            return first.device
    return group.current_device()


class _Share:
    """Window evaluation: this rank's windows (its contiguous share of the batches), run through the model and
    added in window order into canvases over the box they touch. Nothing here communicates: each window output
    another rank's voxels need is handed to ``keep(rank, index, output)`` (the exchange's)."""

    def __init__(self, images, model, roi, overlap, batch_size, blend, precision, pad_mode, *,
                 sigma_scale, cval, device, model_kwargs=None):
        self.images, self.model, self.model_kwargs = images, model, dict(model_kwargs or {})
        self.roi, self.blend, self.sigma_scale = roi, blend, sigma_scale
        self.batch_size, self.pad_mode, self.cval = batch_size, pad_mode, cval
        self.autocast_dtype = PRECISIONS[precision]
        self.device = _model_device(model, device)
        self.plan = WindowPlan([im.shape[1:] for im in images], roi, overlap)
        self.rank, self.world_size, self.distributed = _coords()
        self.bounds = self.plan.rank_bounds(batch_size, self.world_size)
        self.start, self.stop = self.bounds[self.rank]
        in_dtype = images[0].dtype
        self.acc_dtype = torch.float64 if in_dtype == torch.float64 else torch.float32
        self.meta: _OutMeta | None = None
        self.weights: torch.Tensor | None = None
        self.canvases: dict[int, Canvas] = {}
        self.stitch_device = torch.device("cpu")  # the GPU when this rank's canvases fit there (setup_output)
        self._padded: tuple[int, torch.Tensor] | None = None
        self._leaving: list[tuple[list[int], int, torch.Tensor, torch.device]] = []
        """Window outputs other ranks need, on their way to the host (``_stitch``), handed over after the loop."""

    def _fits_on_device(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in a quarter of the GPU's free memory (the model's activations need the rest)."""
        if self.device.type != "cuda":
            return False
        free, _ = torch.cuda.mem_get_info(self.device)
        return nbytes <= free // 4

    def num_batches(self) -> int:
        return -(-(self.stop - self.start) // self.batch_size)

    def _image(self, index: int) -> torch.Tensor:
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
        """This rank's window batches, cut from the image where it lies (the host, or the GPU: ``_image``)."""
        for lo in range(self.start, self.stop, self.batch_size):
            windows = list(self.plan.windows(lo, min(lo + self.batch_size, self.stop)))
            crops = []
            for w in windows:
                index = (slice(None), *(slice(s, s + r) for s, r in zip(w.start, self.roi, strict=True)))
                crops.append(self._image(w.image)[index])
            x = torch.stack(crops)
            yield windows, (x if x.is_floating_point() else x.float())

    def _to_device(self, item):
        if item is None or self.device.type == "cpu":
            return item
        windows, x = item
        if x.device.type != "cpu":  # cut from an image already on a GPU: nothing to pin (torch refuses to)
            return windows, x.to(self.device, non_blocking=True)
        # pinned memory + non_blocking: the copy overlaps the model still running on the previous batch
        return windows, x.pin_memory().to(self.device, non_blocking=True)

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

    def _check_output(self, out, x: torch.Tensor) -> _OutMeta:
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
        return _OutMeta(int(out.shape[1]), tuple(scale), self.acc_dtype)

    def setup_output(self, meta: _OutMeta) -> None:
        if self.meta is not None and self.meta != meta:
            raise ConfigError(f"the model's output changed between batches: {self.meta} then {meta}")
        self.meta = meta
        out_size = [r * z for r, z in zip(self.roi, meta.scale, strict=True)]
        # this rank's canvases: the sums and the weights over the box its windows touch, in every image they touch
        canvas_bytes = sum((meta.channels + 1) * math.prod(b - a for a, b in self.plan.output_box(
            image, self.start, self.stop, meta.scale)) for image in self.plan.images_in(self.start, self.stop))
        if self._fits_on_device(canvas_bytes * self.acc_dtype.itemsize):
            self.stitch_device = self.device
        self.weights = importance_map(self.roi, self.blend, sigma_scale=self.sigma_scale, out_size=out_size,
                                      dtype=self.acc_dtype).to(self.stitch_device)

    def _canvas(self, image: int) -> Canvas:
        if image not in self.canvases:
            box = self.plan.output_box(image, self.start, self.stop, self.meta.scale)
            self.canvases[image] = Canvas(self.meta.channels, box, self.acc_dtype, self.stitch_device)
        return self.canvases[image]

    def _weights_of(self, w: Window) -> torch.Tensor:
        """The window's weight map: the same for every window, except under ``blend="crop"``."""
        if self.blend != "crop":
            return self.weights
        grid = self.plan.grids[w.image]
        return crop_mask(self.weights, grid.starts, self.roi, grid.grid_index(w.local), self.meta.scale)

    def add(self, index: int, y: torch.Tensor) -> None:
        """Add the weighted output of window ``index``, sent by another rank, into the canvas of its image (this
        rank owns voxels there, so its own windows made that canvas)."""
        w = self.plan.window(index)
        start = tuple(s * f for s, f in zip(w.start, self.meta.scale, strict=True))
        self.canvases[w.image].add(y, self._weights_of(w), start, weighted=True)

    def _weighted(self, windows: list[Window], out: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Each window's output times its weights: one product for the batch when every window has the same
        weights (MONAI's order: the product, then the adds), else window by window (``blend="crop"``)."""
        if self.blend != "crop":
            return out * self.weights.to(out.device)
        return [y * self._weights_of(w).to(y.device) for w, y in zip(windows, out, strict=True)]

    def _stitch(self, windows: list[Window], out: torch.Tensor, keep: Callable[[int, int, torch.Tensor], None]) -> None:
        """Add each window's weighted output in window order, and hand ``keep`` the ones other ranks' voxels need
        (weighted: the receiver adds them as they are). The exchange sends host tensors (over gloo): a window on a
        GPU starts its copy to the host here without blocking, and is handed over after the model loop
        (:meth:`_hand_over`), so the loop never waits for the GPU at a rank boundary."""
        z = self.meta.scale
        for w, y in zip(windows, self._weighted(windows, out), strict=True):
            start = tuple(s * f for s, f in zip(w.start, z, strict=True))
            self._canvas(w.image).add(y, self._weights_of(w), start, weighted=True)
            if self.distributed:
                owners = np.unique(self.plan.owner(self.plan.first_windows_inside(w.image, w.local, z), self.bounds))
                others = [int(r) for r in owners if r != self.rank]
                if not others:
                    continue
                if y.device.type == "cpu":
                    for r in others:
                        keep(r, w.index, y)
                else:  # into pinned memory (torch allocates it so), behind this batch's kernels
                    self._leaving.append((others, w.index, y.to("cpu", non_blocking=True), y.device))

    def _hand_over(self, keep: Callable[[int, int, torch.Tensor], None]) -> None:
        """After the model loop: one wait for the copies started by :meth:`_stitch` (an event on each copy's
        stream), then every such window to ``keep``, in window order."""
        if not self._leaving:
            return
        for device in {d for *_, d in self._leaving}:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))  # the copies' stream: the output's device's
            ready.synchronize()
        for others, index, host, _ in self._leaving:
            for r in others:
                keep(r, index, host)
        self._leaving = []

    def _to_host(self, out: torch.Tensor) -> tuple[torch.Tensor, Any]:
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

    def _stitch_when_ready(self, windows: list[Window], host: torch.Tensor, ready, keep) -> None:
        if ready is not None:
            ready.synchronize()  # this batch's copy only: the next batch's model is already queued behind it
        self._stitch(windows, host.to(self.acc_dtype), keep)

    def evaluate(self, meter: StepMeter, keep: Callable[[int, int, torch.Tensor], None]) -> None:
        """Run the model over this rank's batches and stitch the outputs, one batch behind the model.

        Batch k is stitched after batch k+1's model call is queued: on a GPU with host canvases the model
        keeps running while the host adds batch k into the canvas (with canvases on the GPU the adds are
        only queued behind it), and no step waits for the whole device. Stitching stays in window order,
        so the output is the same bits.
        """
        with self._autocast():  # once: its cast weights are kept from one batch to the next
            self._evaluate(meter, keep)
        with _phase("blend"):
            self._hand_over(keep)

    def _evaluate(self, meter: StepMeter, keep: Callable[[int, int, torch.Tensor], None]) -> None:
        batches = iter(self._batches())
        with _phase("cut"):
            current = self._to_device(next(batches, None))
        behind = None  # (windows, host output, event) of the batch whose model call came before
        while current is not None:
            windows, x = current
            with meter.step(items=len(windows)):
                with _phase("model"):  # on a GPU: the time to queue it, the wait shows in "blend"
                    out = self._forward(x)
                with _phase("cut"):  # queued on a GPU; the next batch is cut and copied meanwhile
                    current = self._to_device(next(batches, None))
                meta = self._check_output(out, x)
                if self.meta is None or meta != self.meta:
                    self.setup_output(meta)
                queued = (windows, *self._to_host(out))
                with _phase("blend"):
                    if behind is not None:
                        self._stitch_when_ready(*behind, keep)
                    behind = queued
                    if current is None:  # the last batch: nothing left to queue before it
                        self._stitch_when_ready(*behind, keep)


class _Layout:
    """How the output is cut for assembly: per image, slabs of rows, each cut into blocks owned by one rank (the
    rank of its lowest covering window). The same on every rank; no communication."""

    def __init__(self, share: _Share):
        self.plan, self.bounds, self.acc_dtype = share.plan, share.bounds, share.acc_dtype

    def blocks(self, image: int, rows: tuple[int, int, int], z: tuple[int, ...]
               ) -> list[tuple[tuple[tuple[int, int], ...], int]]:
        """The blocks of one slab (``rows`` = start, stop, grid index along dim 0) and the rank owning each."""
        grid = self.plan.grids[image]
        crop = self.plan.crop_box(image, z)
        runs = [self.plan.segments(image, d, a, b, z[d]) for d, (a, b) in enumerate(crop) if d > 0]
        out = []
        for combo in itertools.product(*runs):
            first = rows[2] * grid.strides[0] + sum(i * grid.strides[d + 1] for d, (_, _, i) in enumerate(combo))
            owner = int(self.plan.owner(first + self.plan.offsets[image], self.bounds))
            out.append((((rows[0], rows[1]), *((a, b) for a, b, _ in combo)), owner))
        return out

    def slabs(self, image: int, z: tuple[int, ...]) -> Iterator[tuple[int, int, int]]:
        """Runs of output rows with one lowest covering window row, cut to at most ``_SLAB_VOXELS`` voxels."""
        crop = self.plan.crop_box(image, z)
        step = max(1, _SLAB_VOXELS // max(math.prod(b - a for a, b in crop[1:]), 1))
        for a, b, i in self.plan.segments(image, 0, *crop[0], z[0]):
            for y in range(a, b, step):
                yield y, min(y + step, b), i

    def view(self, image: int, out: torch.Tensor, z: tuple[int, ...]):
        crop = self.plan.crop_box(image, z)

        def view(box):
            return out[(slice(None), *(slice(a - c, b - c) for (a, b), (c, _) in zip(box, crop, strict=True)))]
        return view

    def flat_blocks(self, blocks, canvas: Canvas | None, owner: int, channels: int) -> torch.Tensor:
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
    def place(image: int, parts: torch.Tensor, boxes, view) -> None:
        offset = 0
        for box in boxes:
            target = view(box)
            target.copy_(parts[offset:offset + target.numel()].reshape(target.shape))
            offset += target.numel()
        if offset != parts.numel():
            raise RuntimeError(f"image {image}: ranks sent {parts.numel()} values for {offset}; "
                               "every voxel must have exactly one owner")


class _Exchange:
    """The exchange between ranks: the later windows each owner's voxels need (its *spill*), and the last rank's
    early path. The last rank's voxels need no other rank's windows, so it sends its spill as it evaluates and
    then its blended voxels to rank 0, point to point; a receiver thread on ranks 0..last-1 takes them while
    those ranks still evaluate. The others' spill goes by ``gather`` per owner once every rank is done."""

    def __init__(self, share: _Share, layout: _Layout):
        self.share, self.layout = share, layout
        self.rank, self.world_size, self.distributed = share.rank, share.world_size, share.distributed
        self.last = self.world_size - 1
        # ranks 0..last-1 take the last rank's data on a thread; in a group of one rank 0 is the last and takes its own
        self.receivers = range(max(self.last, 1))
        # CPU tensors over gloo: a receive never makes a CUDA stream wait (group.exchange_group); all ranks call it
        self.pg = group.exchange_group() if self.distributed else None
        self.spill: dict[int, list[tuple[int, torch.Tensor]]] = {r: [] for r in range(self.world_size)}
        self.late_spill: list[tuple[int, torch.Tensor]] = []  # the last rank's windows, received point to point
        self.outputs = None  # rank 0: (result, views), allocated by the receiver thread or after the exchange
        self._receiver: threading.Thread | None = None
        self._receiver_error: BaseException | None = None
        self._sending: list[collectives.Pending] = []  # the last rank's sends under way

    def early(self, owner: int) -> bool:
        """Whether ``owner``'s voxels reach rank 0 point to point, right after its windows (the last rank's do)."""
        return self.distributed and owner == self.last

    def keep(self, owner: int, index: int, y: torch.Tensor) -> None:
        """Window ``index``'s output ``y``, which rank ``owner``'s voxels need: the last rank sends it now (the
        owner's receiver thread takes it), the others keep a copy for the exchange after evaluation."""
        if self.rank == self.last:
            EXCHANGE_STATS["spill"] = EXCHANGE_STATS.get("spill", 0) + y.numel() * y.element_size()
            self._sending += [collectives.isend(torch.tensor([index]), owner, pg=self.pg),
                              collectives.isend(y, owner, pg=self.pg)]
        else:
            self.spill[owner].append((index, y.clone()))

    # ---- the last rank, point to point: its spill and its voxels go out as soon as it has them ------------

    def send_owned(self) -> None:
        """On the last rank: end every owner's spill, then send rank 0 its own blended voxels, slab by slab.

        Its voxels need nothing from any other rank (every window covering them is
        its own), so they are final now, while rank 0 may still be evaluating.
        """
        meta = self.share.meta
        for r in self.receivers:
            self._sending.append(collectives.isend(torch.tensor([-1]), r, pg=self.pg))
        z = meta.scale if meta is not None else ()
        header = [meta.channels, *z] if meta is not None else []
        self._sending.append(collectives.isend(torch.tensor(header, dtype=torch.int64), 0, pg=self.pg))
        for pending in self._sending:  # the window outputs they hold are freed as they arrive
            pending.wait()
        self._sending = []
        if meta is None:
            return  # no windows here: it owns no voxel
        previous = None  # at most two slabs in flight: one blended while the other travels
        for image in range(len(self.share.images)):
            canvas = self.share.canvases.get(image)
            for rows in self.layout.slabs(image, z):
                blocks = self.layout.blocks(image, rows, z)
                if any(o == self.rank for _, o in blocks):
                    flat = self.layout.flat_blocks(blocks, canvas, self.rank, meta.channels)
                    pending = collectives.isend(flat, 0, pg=self.pg)
                    if previous is not None:
                        previous.wait()
                    previous = pending
        if previous is not None:
            previous.wait()

    def start_receiving(self, allocate: Callable[[_OutMeta], tuple]) -> None:
        """On ranks 0..last-1: a thread takes the last rank's spill (and, on rank 0, its voxels) while this rank
        evaluates its own windows. ``allocate(meta)`` gives rank 0's output (result, per-image views)."""
        def run():
            try:
                with torch.inference_mode():
                    self._receive_early(allocate)
            except BaseException as exc:  # re-raised by finish_receiving on the main thread
                self._receiver_error = exc

        self._receiver = threading.Thread(target=run, name="multigpu-infer-receive", daemon=True)
        self._receiver.start()

    def _receive_early(self, allocate) -> None:
        while True:
            index = int(collectives.recv(self.last, pg=self.pg).item())
            if index < 0:
                break
            self.late_spill.append((index, collectives.recv(self.last, pg=self.pg)))
        if self.rank != 0:
            return
        header = collectives.recv(self.last, pg=self.pg).tolist()
        if not header:
            return
        meta = _OutMeta(header[0], tuple(header[1:]), self.share.acc_dtype)
        self.outputs = allocate(meta)
        for image, out in enumerate(self.outputs[1]):
            view = self.layout.view(image, out, meta.scale)
            for rows in self.layout.slabs(image, meta.scale):
                boxes = [box for box, o in self.layout.blocks(image, rows, meta.scale) if o == self.last]
                if boxes:
                    self.layout.place(image, collectives.recv(self.last, pg=self.pg), boxes, view)

    def finish_receiving(self) -> None:
        if self._receiver is not None:
            self._receiver.join()
            self._receiver = None
        if self._receiver_error is not None:
            raise self._receiver_error

    # ---- after every rank's windows -------------------------------------------------------------------

    def agree_on_output(self) -> None:
        """Every rank learns the output channels and scale (a rank without windows never ran the model)."""
        meta = self.share.meta
        metas = collectives.all_gather([meta] if meta is not None else []) if self.distributed else (
            [meta] if meta is not None else [])
        if not metas:
            raise ConfigError("there are no windows to evaluate")
        if any(m != metas[0] for m in metas):
            raise ConfigError(f"ranks disagree on the model's output (channels, scale, dtype): {metas}")
        if meta is None:
            self.share.setup_output(metas[0])

    def exchange_spill(self) -> None:
        """Send each owner the later windows that touch its voxels; it adds them in window order."""
        if not self.distributed:
            return
        with _phase("spill"):
            EXCHANGE_STATS["spill"] = EXCHANGE_STATS.get("spill", 0) + sum(
                y.numel() * y.element_size() for r in self.spill.values() for _, y in r)
            for dst in range(self.world_size - 2):  # ranks 1..last-1 spill through gathers (none on 2 ranks)
                received = collectives.gather(self.spill.pop(dst), dst=dst)
                if received is None:
                    continue
                for index, y in received:  # rank order, then window order within a rank = window order
                    self.share.add(index, y)
            # the last rank's windows are the latest of all: added after the others keeps window order
            for index, y in self.late_spill:
                self.share.add(index, y)
            self.late_spill = []


def _assemble(share: _Share, layout: _Layout, exchange: _Exchange, image: int, out: torch.Tensor | None) -> None:
    """Assembly: fill ``out`` (rank 0's ``(C, *size)`` view of the output) from every rank, slab by slab.

    A slab is cut into blocks, each owned by one rank (:meth:`_Layout.blocks`); rank 0 copies its own blocks,
    and receives the blocks of ranks 1..last-1, flattened and concatenated in rank order then block order,
    with one ``gather`` (none where they own nothing). The last rank's blocks are already there
    (``send_owned`` / the receiver thread).
    """
    z, channels = share.meta.scale, share.meta.channels
    view = layout.view(image, out, z) if out is not None else None
    canvas = share.canvases.get(image)
    for rows in layout.slabs(image, z):
        blocks = layout.blocks(image, rows, z)
        if share.rank == 0:
            with _phase("assemble"):
                for box, owner in blocks:
                    if owner == 0 and not exchange.early(0):  # (in a group of one, rank 0's came as the last's)
                        canvas.blended(box, out=view(box))  # divided straight into the output
        if any(owner > 0 and not exchange.early(owner) for _, owner in blocks):  # the same answer on every rank
            with _phase("gather"):  # rank 0 receives ranks 1..last-1's blocks, in rank order then block order
                if share.rank != 0 and not exchange.early(share.rank):
                    sent = layout.flat_blocks(blocks, canvas, share.rank, channels)
                else:
                    sent = torch.empty(0, dtype=share.acc_dtype)
                parts = collectives.gather(sent, dst=0)
                if parts is not None:
                    wanted = sorted((b for b in blocks if b[1] != 0 and not exchange.early(b[1])),
                                    key=lambda b: b[1])  # stable
                    layout.place(image, parts, [box for box, _ in wanted], view)
    share.canvases.pop(image, None)


def _whole_canvas(share: _Share, groups: list[int] | None) -> torch.Tensor | None:
    """One process and one image whose canvas is exactly its output (no padding to crop): the sums divided in place
    and returned (on the host), as MONAI does; no second image-sized buffer. None in every other case."""
    if share.distributed or groups is not None or len(share.images) != 1 or share.meta is None:
        return None
    canvas = share.canvases.get(0)
    if canvas is None or canvas.box != share.plan.crop_box(0, share.meta.scale):
        return None
    share.canvases.pop(0)
    return canvas.acc.div_(canvas.weight).to("cpu")  # the same quotient as blended(); on a GPU, one copy back


def sliding_window(
    inputs: torch.Tensor | Sequence[torch.Tensor],
    model: Callable[[torch.Tensor], torch.Tensor],
    roi: int | Sequence[int],
    overlap: float | Sequence[float] = 0.25,
    batch_size: int = 8,
    blend: str = "constant",
    precision: str = "fp32",
    pad_mode: str = "constant",
    progress: bool = True,
    *,
    sigma_scale: float | Sequence[float] = 0.125,
    cval: float = 0.0,
    device: torch.device | str | None = None,
    run_dir=None,
    meter: StepMeter | None = None,
    model_kwargs: dict | None = None,
):
    """Run ``model`` over overlapping windows of every image and blend the outputs, split over all ranks.

    Must be called on all ranks with the same inputs and arguments (or without
    ``mg.init``: one process). Each window is evaluated by exactly one rank;
    the result, on rank 0, is bitwise identical for any number of ranks (see
    the module docstring for what that needs of the model).

    Args:
        inputs: ``(N, C, H, W)`` or ``(N, C, D, H, W)``, or a list of such tensors
            of different spatial sizes (any dtype; windows are cast to float32).
        model: Maps a window batch ``(B, C, *roi)`` to ``(B, C_out, *(roi * scale))``
            for an integer ``scale`` per dim (1: same size; 2: x2 super-resolution); or to a tuple,
            list or dict of such tensors (same scale), each stitched on its own. An ``nn.Module`` or
            any callable (a closure, ``functools.partial``): the modules it holds are moved to ``device``.
        roi: Window size, one int or one per spatial dim. An image smaller than
            the roi in a dim is padded there (``pad_mode``) and cropped back after.
        overlap: Fraction of a window shared with its neighbour, in [0, 1), one or per dim.
        batch_size: Windows per model call.
        blend: ``"constant"`` (plain mean), ``"gaussian"`` (window edges weigh less) or ``"crop"`` (each
            window keeps only its inner part, up to the middle of its overlaps: every voxel from one window).
        precision: ``"fp32"``, or ``"bf16"`` / ``"fp16"`` autocast around the model.
        pad_mode: ``"constant"`` (``cval``), ``"reflect"``, ``"replicate"`` or ``"circular"``.
        progress: Progress bar (windows/s) on rank 0 when stderr is a terminal.
        sigma_scale: Gaussian sigma as a fraction of the roi (MONAI's default 0.125).
        cval: Fill value for constant padding.
        device: Where windows go (default: the model's parameters' device, else ``mg.device()``).
        run_dir: Where rank 0 writes the step meter's ``summary.json`` (None: nowhere).
        meter: A ``StepMeter`` to record into (one step per window batch; a job's: its run's ``run.meter``); it is
            then left open for the caller to ``close()``. Default: the meter of a run harness
            (:class:`multigpu.run.Run`) made and closed here.
        model_kwargs: Extra keyword arguments of every model call (e.g. ``{"sigma": 0.05}`` for
            DeepInverse's DRUNet, which takes ``model(x, sigma)``).

    Returns:
        On rank 0, the blended output on the CPU: a tensor ``(N, C_out, *spatial * scale)``
        for a tensor input, a list of them for a list; float32 (float64 for float64 input);
        the model's tuple/list/dict structure around them when it returns one.
        ``None`` on the other ranks.

    Example (world_size=2; 121 windows of a 2048x2048 image)::

        out = multigpu.infer.sliding_window(image, model, roi=256, overlap=0.25, batch_size=8)
        # rank 0 evaluates windows 0..63, rank 1 windows 64..120
        # rank 0 -> tensor (1, C_out, 2048, 2048); rank 1 -> None
    """
    EXCHANGE_STATS.clear()
    PHASE_SECONDS.clear()
    images, groups = _flatten(inputs)
    roi, overlap = _check_args(roi, overlap, batch_size, blend, precision, pad_mode, images[0].dim() - 1)
    packed = _Packed(model)
    if device is None and not isinstance(model, torch.nn.Module):
        device = _held_device(model)
    share = _Share(images, packed, roi, overlap, batch_size, blend, precision, pad_mode,
                   sigma_scale=sigma_scale, cval=cval, device=device, model_kwargs=model_kwargs)
    layout = _Layout(share)
    exchange = _Exchange(share, layout)
    _move_held_modules(model, share.device)
    run = None
    if meter is None:  # a call of its own: the run harness's meter (summary.json in run_dir; the launcher's sampler)
        from multigpu.run import Run, script_context

        run = Run(script_context(run_dir), total=share.num_batches(), unit="windows", description="infer",
                  checkpoint_last=False, progress=progress)  # one pass: no checkpoints
        meter = run.meter
    with torch.inference_mode():  # canvases too: in-place adds into inference tensors need it
        # 1. this rank's windows into its canvases; meanwhile a thread takes what the last rank sends early
        if exchange.distributed and exchange.rank in exchange.receivers:
            exchange.start_receiving(functools.partial(_allocate, images, groups))
        share.evaluate(meter, exchange.keep)  # on an error the receiver (a daemon thread) is left to the process's end
        # 2. the exchange: the last rank's voxels to rank 0, every owner's spill, the output's shape agreed
        if exchange.distributed and exchange.rank == exchange.last:
            with _phase("gather"):
                exchange.send_owned()
        with _phase("idle"):  # the last rank's data (received meanwhile), then the slowest rank's windows
            exchange.finish_receiving()
            exchange.agree_on_output()
        exchange.exchange_spill()
        # 3. assembly on rank 0, slab by slab (one process, one image: its canvas divided in place)
        with _phase("assemble"):
            whole = _whole_canvas(share, groups)
            outputs = (whole[None], None) if whole is not None else exchange.outputs or (
                _allocate(images, groups, share.meta) if share.rank == 0 else None)
        if whole is None:
            for i in range(len(images)):
                _assemble(share, layout, exchange, i, None if outputs is None else outputs[1][i])
    if run is not None:
        run.close({"num_windows": share.plan.num_windows, "num_images": len(images), "roi": list(roi)})
    return None if outputs is None else packed.unpack(outputs[0])


class _Packed:
    """The model, its tuple/list/dict outputs concatenated along channels (one stitch), split back after."""

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
            return out  # _check_output names what came back
        if not parts or not all(isinstance(p, torch.Tensor) and p.dim() == x.dim() for p in parts):
            raise ConfigError("the model returned a tuple/list/dict whose parts are not all (N, C, *spatial) tensors")
        if len({tuple(p.shape[2:]) for p in parts}) != 1:
            raise ConfigError(f"the model's outputs have different spatial sizes {[tuple(p.shape) for p in parts]}; "
                              "sliding_window stitches outputs of one scale")
        self.structure = (type(out), keys, [int(p.shape[1]) for p in parts])
        return torch.cat([p.float() if p.dtype != parts[0].dtype else p for p in parts], dim=1)

    def unpack(self, result):
        if self.structure is None:
            return result
        if isinstance(result, list):
            return [self.unpack(r) for r in result]
        kind, keys, channels = self.structure
        parts = torch.split(result, channels, dim=1)
        if kind is dict or issubclass(kind, dict):
            return dict(zip(keys, parts, strict=True))
        return kind(parts) if kind in (tuple, list) else tuple(parts)


def _held_modules(fn, depth: int = 0) -> list[torch.nn.Module]:
    """The ``nn.Module`` objects a plain callable holds: a partial's function and arguments, a closure's cells,
    a bound method's object (looked into a few levels deep)."""
    if isinstance(fn, torch.nn.Module):
        return [fn]
    if depth > 3:
        return []
    found: list = []
    if hasattr(fn, "func") and hasattr(fn, "keywords"):  # functools.partial
        for item in (fn.func, *fn.args, *fn.keywords.values()):
            found += _held_modules(item, depth + 1)
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            found += _held_modules(cell.cell_contents, depth + 1)
        except ValueError:  # an empty cell
            continue
    owner = getattr(fn, "__self__", None)
    if owner is not None:
        found += _held_modules(owner, depth + 1)
    return found


def _held_device(fn) -> torch.device | None:
    for module in _held_modules(fn):
        first = next(iter(module.parameters()), None)
        if first is not None and first.device.type != "cpu":
            return first.device
    return None


def _move_held_modules(fn, device: torch.device) -> None:
    if not isinstance(fn, torch.nn.Module):
        for module in _held_modules(fn):
            module.to(device)


def sliding_window_inference(inputs, roi_size, sw_batch_size, predictor, overlap=0.25, mode="constant",
                             sigma_scale=0.125, padding_mode="constant", cval=0.0, sw_device=None, device=None,
                             progress=False, *args, **kwargs):
    """MONAI's ``sliding_window_inference``, by its own names and argument order, run over every rank.

    A MONAI user swaps the import; ``*args`` and ``**kwargs`` reach ``predictor`` as MONAI passes them.
    The output is on ``device`` (default: the input's device) on rank 0, and ``None`` on the other ranks;
    MONAI's ``roi_weight_map``, ``process_fn``, ``buffer_steps`` and ``with_coord`` are not supported.
    """
    for name in ("roi_weight_map", "process_fn", "buffer_steps", "buffer_dim", "with_coord"):
        if kwargs.pop(name, None) not in (None, -1, False):
            raise ConfigError(f"sliding_window_inference: MONAI's {name} is not supported here")
    model = predictor if not args else functools.partial(_with_args, predictor, args)
    out = sliding_window(inputs, model, roi_size, overlap, sw_batch_size, blend=mode, pad_mode=padding_mode,
                         progress=progress, sigma_scale=sigma_scale, cval=cval, device=sw_device, model_kwargs=kwargs)
    if out is None:
        return None
    target = device if device is not None else (inputs.device if isinstance(inputs, torch.Tensor) else None)
    if target is None:
        return out
    return _to(out, target)


def _with_args(predictor, args, x, **kwargs):
    return predictor(x, *args, **kwargs)


def _to(out, device):
    if isinstance(out, torch.Tensor):
        return out.to(device)
    if isinstance(out, dict):
        return {k: _to(v, device) for k, v in out.items()}
    return type(out)(_to(v, device) for v in out)


def _allocate(images: list[torch.Tensor], groups: list[int] | None, meta: _OutMeta):
    """Rank 0's output tensors and a ``(C_out, *size)`` view per image to fill."""

    def size(image: int) -> tuple[int, ...]:
        return tuple(s * z for s, z in zip(images[image].shape[1:], meta.scale, strict=True))

    if groups is None:
        out = torch.empty((len(images), meta.channels, *size(0)), dtype=meta.dtype)
        return out, list(out)
    result, views, i = [], [], 0
    for n in groups:
        t = torch.empty((n, meta.channels, *(size(i) if n else ())), dtype=meta.dtype)
        result.append(t)
        views.extend(t)
        i += n
    return result, views
