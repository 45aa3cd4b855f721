"""Distributed sliding-window inference: ``sliding_window`` (runs inside each rank; call on all ranks).

How the work and the output are split (windows.py numbers the windows), in three phases, one module each:

1. **Windows, exactly once** (:mod:`multigpu.infer.evaluate`). The windows of all images, numbered in order,
   are cut into batches of ``batch_size``; the batches are sharded like ``mg.shard`` (contiguous, sizes differ
   by at most one batch). A rank evaluates only its windows, so its windows form a band of the image and it
   allocates a canvas (``stitch.Canvas``) only over the box they touch; on a GPU, windows are cut and stitched
   there.
2. **Owners, for a result independent of the split** (:mod:`multigpu.infer.exchange`). Overlapping window
   outputs are added in window order (as one process, and MONAI, would). Each output voxel belongs to the rank
   holding its *lowest* covering window (:mod:`multigpu.infer.layout`); that rank has already added its own
   windows in order and needs only the outputs of the later windows (of later ranks) that touch its voxels: a
   band about one window row deep. Those are sent to it once, and it adds them in window order. The last rank
   goes first: its voxels need no other rank's windows, so it sends what the others need while they still
   evaluate.
3. **Rank 0 assembles** the blended voxels slab by slab (:mod:`multigpu.infer.assemble`: ``gather`` of each
   rank's owned voxels in a slab), so its memory holds the output plus its own canvas and one slab per rank,
   never a number of windows.

Each window batch is one step of the run harness's meter (:class:`multigpu.run.Run`'s, as for every workload:
the ``infer`` job passes its run's meter, and a call without one makes a run of its own, with no checkpoint, for
the meter and ``summary.json``); the model loop is the only loop. :mod:`multigpu.infer.stats` keeps the seconds
per phase and the bytes exchanged of the last call, for benchmarks.

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

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch

from multigpu.errors import ConfigError
from multigpu.infer import stats
from multigpu.infer.assemble import allocate_outputs, assemble_image, whole_canvas
from multigpu.infer.evaluate import PAD_MODES, PRECISIONS, PackedModel, RankWindows
from multigpu.infer.exchange import WindowExchange
from multigpu.infer.layout import OutputLayout
from multigpu.infer.stitch import BLENDS
from multigpu.infer.windows import as_tuple
from multigpu.monitor import StepMeter

__all__ = ["PAD_MODES", "PRECISIONS", "sliding_window", "sliding_window_inference"]


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


def _one_pass_run(run_dir, total: int, progress: bool):
    """A run of one pass, for its meter: no checkpoint, and nothing resumed (there is nothing to resume)."""
    from multigpu.run import Run, script_context

    ctx = dataclasses.replace(script_context(run_dir), resume_decided=True)
    return Run(ctx, total=total, checkpoint_last=False, unit="windows", description="infer", progress=progress)


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
        meter: A ``StepMeter`` to record into (one step per window batch); it is then
            left open for the caller to ``close()``. Default: the meter of a run made and closed here
            (:class:`multigpu.run.Run`, no checkpoint).
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
    stats.reset()
    images, groups = _flatten(inputs)
    roi, overlap = _check_args(roi, overlap, batch_size, blend, precision, pad_mode, images[0].dim() - 1)
    packed = PackedModel(model)
    if device is None and not isinstance(model, torch.nn.Module):
        device = _held_device(model)
    rank_windows = RankWindows(images, packed, roi, overlap, batch_size, blend, precision, pad_mode,
                               sigma_scale=sigma_scale, cval=cval, device=device, model_kwargs=model_kwargs)
    layout = OutputLayout(rank_windows.plan, rank_windows.rank_bounds, rank_windows.acc_dtype)
    exchange = WindowExchange(rank_windows, layout)
    _move_held_modules(model, rank_windows.device)
    run = _one_pass_run(run_dir, rank_windows.num_batches(), progress) if meter is None else None
    with torch.inference_mode():  # canvases too: in-place adds into inference tensors need it
        # 1. this rank's windows into its canvases; meanwhile a thread takes what the last rank sends early
        if exchange.distributed and exchange.rank in exchange.receivers:
            exchange.start_receiving(functools.partial(allocate_outputs, images, groups))
        # on an error the receiver (a daemon thread) is left to the process's end
        rank_windows.evaluate(run.meter if run is not None else meter, exchange.route)
        # 2. the exchange: the last rank's voxels to rank 0, every owner's spill, the output's shape agreed
        if exchange.distributed and exchange.rank == exchange.last:
            with stats.timed_phase("gather"):
                exchange.send_owned()
        with stats.timed_phase("idle"):  # the last rank's data (received meanwhile), then the slowest rank's windows
            exchange.finish_receiving()
            exchange.agree_on_output()
        exchange.exchange_spill()
        # 3. assembly on rank 0, slab by slab (one process, one image: its canvas divided in place)
        with stats.timed_phase("assemble"):
            whole = whole_canvas(rank_windows, groups)
            outputs = (whole[None], None) if whole is not None else exchange.outputs or (
                allocate_outputs(images, groups, rank_windows.spec) if rank_windows.rank == 0 else None)
        if whole is None:
            for i in range(len(images)):
                assemble_image(rank_windows, layout, exchange, i, None if outputs is None else outputs[1][i])
    if run is not None:
        run.close({"num_windows": rank_windows.plan.num_windows, "num_images": len(images), "roi": list(roi)})
    return None if outputs is None else packed.unpack(outputs[0])


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
    return _output_moved_to(out, target)


def _with_args(predictor, args, x, **kwargs):
    return predictor(x, *args, **kwargs)


def _output_moved_to(out, device):
    """The output (a tensor, or the model's tuple/list/dict of them) on ``device``."""
    if isinstance(out, torch.Tensor):
        return out.to(device)
    if isinstance(out, dict):
        return {k: _output_moved_to(v, device) for k, v in out.items()}
    return type(out)(_output_moved_to(v, device) for v in out)
