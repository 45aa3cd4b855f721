"""The ``infer`` workload: sliding-window inference of large images over every rank (both sides).

    multigpu infer --model multigpu.infer.models:denoiser --input big.tif --output out/ --roi 256 --overlap 0.25
    multigpu infer --model mypkg.models:sr --input a.png b.png --output out/ --blend gaussian --precision bf16 --gpus all
    multigpu infer -f infer.yaml --nproc-per-node 2 batch_size=16
    multigpu infer                                  # the demo: the denoiser on a noisy sample photo
    multigpu bench --nproc 1,2 infer roi=[256]

``check`` (in the launcher, before a rank starts or a file is written): the
outputs (none overwrites an input, no two inputs share an output name), the
images (exist, readable, channels), the roi (no larger than the largest image),
the overlap, the model (imports, takes the images' channels, returns an
integer multiple of the roi), and what cannot fit: a window count that would
put every pixel through the model more than :data:`MAX_PASSES` times, and
rank 0's images, output and canvas beyond its share of the memory. ``main`` (every rank) reads every image, builds
the model and calls :func:`~multigpu.infer.sliding_window`; rank 0 writes one
output per input (atomically), ``outputs.json`` and the step meter's
``summary.json`` (windows/s). Under weak scaling the list of images is
repeated ``problem_scale`` times; only the first copy's outputs are written.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from multigpu.argtypes import positive_float, positive_int
from multigpu.errors import ConfigError
from multigpu.infer.config import InferConfig
from multigpu.jobs.workload import Flag, JobPlan, Workload
from multigpu.runtime.context import RunContext

__all__ = ["WORKLOAD", "check", "main"]

MAX_PASSES = 256
"""Most times the windows may cover each pixel on average (windows × roi pixels / image pixels). An overlap
of 0.5 in 2-D is about 4, 0.75 about 16; 0.999999 with a 256 roi on a 1024² image is about 38,000."""


def _first_in_channels(model) -> int | None:
    modules = model.modules() if hasattr(model, "modules") else []
    for m in modules:
        if isinstance(getattr(m, "in_channels", None), int):
            return m.in_channels
    return None


def check_inputs(cfg: InferConfig) -> tuple[list, int, tuple]:
    """Probe every image and the model; raise ConfigError naming the first problem."""
    import torch

    from multigpu.infer import io
    from multigpu.infer.models import DEMO_SIZE, load_model
    from multigpu.infer.windows import as_tuple

    infos = ([io.probe(p, cfg.max_decode_ratio) for p in cfg.inputs] if cfg.inputs
             else [io.ImageInfo("<demo photo>", 3, DEMO_SIZE)])
    ndim = _spatial_dims(infos)
    roi = as_tuple(cfg.roi, ndim, "roi")
    as_tuple(cfg.overlap, ndim, "overlap")
    largest = tuple(max(i.size[d] for i in infos) for d in range(ndim))
    if any(r > s for r, s in zip(roi, largest, strict=True)):
        raise ConfigError(f"--roi {' '.join(map(str, cfg.roi))} is larger than the largest input "
                          f"({'x'.join(map(str, largest))}); valid: a roi up to that size (smaller images are padded)")
    channels = {i.channels for i in infos}
    if len(channels) > 1:
        raise ConfigError("the inputs have different channel counts: "
                          + ", ".join(f"{i.path}: {i.channels}" for i in infos) + "; run them separately")
    c = infos[0].channels
    model = load_model(cfg.model)
    wanted = _first_in_channels(model)
    name = cfg.model.factory
    if wanted is not None and wanted != c:
        raise ConfigError(f"'{infos[0].path}' has {c} channel(s) but the model {name} takes {wanted}")
    from multigpu.infer.runner import _Packed

    try:
        with torch.inference_mode():
            out = _Packed(model)(torch.zeros((1, c, *roi)), **cfg.call_kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the user's model on a test window
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        builtin = "; the built-in models (denoiser, edges, upsample2x) are 2-D: a volume needs a 3-D model of yours " \
                  "(--model pkg.module:factory)" if ndim == 3 and name.startswith("multigpu.infer.models:") else ""
        raise ConfigError(f"the model {name} failed on a test window of shape {(1, c, *roi)} "
                          f"(the images have {c} channel(s)): {first}{builtin}") from None
    if (not isinstance(out, torch.Tensor) or out.dim() != ndim + 2
            or any(o % r for o, r in zip(out.shape[2:], roi, strict=True))):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        axes = ", ".join(f"{a}*k" for a in "DHW"[3 - ndim:])
        raise ConfigError(f"the model {name} turned a window {(1, c, *roi)} into {shape}; "
                          f"it must return (1, C_out, {axes}) for a whole number k")
    if out.shape[1] not in (1, 3, 4) and any(io.output_path(cfg.output or ".", p).suffix == ".png" for p in cfg.inputs):
        raise ConfigError(f"the model returns {out.shape[1]} channels, which PNG cannot hold; use TIFF inputs")
    if cfg.output and Path(cfg.output).exists() and not Path(cfg.output).is_dir():
        raise ConfigError(f"--output '{cfg.output}' exists and is not a folder")
    return infos, c, tuple(out.shape[1:])


def _spatial_dims(infos: list) -> int:
    """2 or 3: every input must have the same (3-D volumes get 3-D windows)."""
    dims = {len(i.size) for i in infos}
    if len(dims) > 1:
        raise ConfigError("the inputs mix 2-D images and 3-D volumes: "
                          + ", ".join(f"{i.path}: {len(i.size)}-D" for i in infos) + "; run them separately")
    return dims.pop()


def _passes(sizes: list[tuple[int, ...]], roi: tuple[int, ...], overlap: tuple[float, ...]) -> tuple[int, float]:
    """(window count, average times each pixel goes through the model) for these images."""
    import math

    from multigpu.infer.windows import WindowPlan

    windows = WindowPlan(sizes, roi, overlap).num_windows
    return windows, windows * math.prod(roi) / sum(math.prod(s) for s in sizes)


def check_windows(cfg: InferConfig, infos: list) -> None:
    """Refuse an overlap that makes far more windows than the images have pixels to cover."""
    from multigpu.infer.windows import as_tuple

    ndim = _spatial_dims(infos)
    roi, overlap = as_tuple(cfg.roi, ndim, "roi"), as_tuple(cfg.overlap, ndim, "overlap")
    sizes = [tuple(i.size) for i in infos]
    windows, passes = _passes(sizes, roi, overlap)
    if passes <= MAX_PASSES:
        return
    # the smallest window step that keeps to the limit (the passes of the ndim dims multiply)
    step = max(-(-r // round(MAX_PASSES ** (1 / ndim))) for r in roi)
    candidates = [1 - step / max(roi), 0.875, 0.75, 0.5, 0.25, 0.0]
    valid = next(o for o in candidates if _passes(sizes, roi, (o,) * ndim)[1] <= MAX_PASSES)
    image = f"{'x'.join(map(str, sizes[0]))} image" if len(sizes) == 1 else f"{len(sizes)} images"
    raise ConfigError(
        f"--overlap {' '.join(f'{o:g}' for o in cfg.overlap)} with --roi {' '.join(map(str, cfg.roi))} makes "
        f"{windows:,} windows for the {image}: every pixel would go through the model about {passes:,.0f} times "
        f"(limit {MAX_PASSES}); valid: --overlap at most {valid:.4g} for this roi (0.25 to 0.5 is usual)")


def check_memory(cfg: InferConfig, infos: list, out_shape: tuple, plan: JobPlan) -> None:
    """Rank 0 holds every input, the stitched outputs and its canvas (host memory): refuse what cannot fit."""
    import math

    from multigpu.units import format_bytes

    memory = plan.devices.memory_per_rank("cpu")
    if memory is None:
        return
    roi = cfg.roi * len(infos[0].size) if len(cfg.roi) == 1 else cfg.roi
    zoom = math.prod(o // r for o, r in zip(out_shape[1:], roi, strict=True))
    copies = plan.run.problem_scale(plan.world_size)  # weak scaling repeats the image list
    held = [i.channels * math.prod(i.size) * 4 for i in infos]  # float32, every image on every rank
    # read one after another: image k's decoding peak on top of the images read before it (io.ImageInfo.read_bytes)
    inputs = max(sum(held[:k]) + i.read_bytes() for k, i in enumerate(infos))
    outputs = sum(out_shape[0] * math.prod(i.size) * zoom for i in infos) * 4 * copies
    canvas = outputs * (out_shape[0] + 1) // out_shape[0] // plan.world_size  # rank 0's band: sums and weights
    need = inputs + outputs + canvas
    if need <= memory:
        return
    what = f"{len(infos)} image(s)" + (f" × {copies} (weak scaling)" if copies > 1 else "")
    raise ConfigError(
        f"the output of {what} does not fit on rank 0: it needs about {format_bytes(need)} (reading the inputs "
        f"{format_bytes(inputs)}, stitched output {format_bytes(outputs)}, its canvas {format_bytes(canvas)}) "
        f"but there is about {format_bytes(memory)} per {plan.devices.memory_words('cpu')}; valid: fewer or "
        f"smaller images per run, fewer ranks on this machine, or a machine with more memory")


def check_outputs(cfg: InferConfig, run_dir: str | None) -> None:
    """No output overwrites an input, and no two inputs write the same output (``a/x.png b/x.png``)."""
    import os

    from multigpu.infer import io

    folder = cfg.output or (str(Path(run_dir) / "out") if run_dir else None)
    if folder is None or not cfg.inputs:
        return
    first: dict[Path, str] = {}
    for name in cfg.inputs:
        target = io.output_path(folder, name).resolve()
        source = Path(name).resolve()
        if target == source or (target.exists() and source.exists() and os.path.samefile(target, source)):
            raise ConfigError(f"--input {name!r} would be overwritten by its own output {target}; valid: an "
                              "--output folder that holds none of the inputs")
        if target in first:
            raise ConfigError(f"--input {first[target]!r} and {name!r} would both be written to {target}; valid: "
                              "inputs whose names differ (outputs keep the name, as .png or .tif), or separate runs")
        if target.is_dir():
            raise ConfigError(f"the output of --input {name!r} would replace the folder {target}; valid: an --output "
                              "folder where no folder has an output's name")
        first[target] = name


def check(cfg: InferConfig, plan: JobPlan) -> InferConfig:
    """The inputs and the model are usable; returns the config with absolute paths (the ranks may run elsewhere)."""
    check_outputs(cfg, plan.run.run_dir)  # before anything is probed or built: names alone
    infos, _channels, out_shape = check_inputs(cfg)
    check_windows(cfg, infos)
    check_memory(cfg, infos, out_shape, plan)
    return dataclasses.replace(cfg, inputs=[str(Path(p).resolve()) for p in cfg.inputs],
                               output=str(Path(cfg.output).resolve()) if cfg.output else "")


def _demo_input(run_dir: Path) -> str:
    """Rank 0 writes the noisy demo photo into the run directory; every rank gets its path."""
    import multigpu as mg
    from multigpu.infer.models import noisy_demo_image

    path = run_dir / "demo_input.png"
    if mg.is_main() and not path.exists():
        noisy_demo_image(path)
    mg.barrier()
    return str(path)


def main(cfg: InferConfig, ctx: RunContext) -> int:
    import tempfile

    import torch
    from torch import nn

    import multigpu as mg
    from multigpu.files import user_made, write_json_atomic
    from multigpu.infer import io
    from multigpu.infer.runner import sliding_window
    from multigpu.infer.windows import WindowPlan, as_tuple
    from multigpu.run import Run

    torch.set_grad_enabled(False)
    # without a run directory (a caller of main() itself): one temporary folder for the job, rank 0's
    run_dir = Path(ctx.run_dir) if ctx.run_dir else Path(mg.broadcast_object(
        tempfile.mkdtemp(prefix="multigpu_infer_") if mg.is_main() else None))
    inputs = cfg.inputs or [_demo_input(run_dir)]
    output = cfg.output or str(run_dir / "out")
    from multigpu.infer.models import load_model

    model = load_model(cfg.model)
    if isinstance(model, nn.Module):
        model = model.to(mg.device()).eval()  # a plain callable's modules are moved by sliding_window
    images = [io.read_image(p, cfg.max_decode_ratio) for p in inputs] * ctx.problem_scale(mg.world_size())
    run = Run(ctx, unit="windows", description="infer", checkpoint_last=False)  # one pass: no checkpoints
    start = time.perf_counter()
    outputs = sliding_window(images, model, cfg.roi, cfg.overlap, cfg.batch_size, cfg.blend, cfg.precision,
                             cfg.pad_mode, sigma_scale=cfg.sigma_scale, meter=run.meter, model_kwargs=cfg.call_kwargs)
    if outputs is not None and not isinstance(outputs[0], torch.Tensor):
        raise ConfigError("multigpu infer writes one image per input; this model returns several outputs per window "
                          "(use sliding_window from Python for those)")
    seconds = time.perf_counter() - start
    # what `multigpu verify --nproc 1,2 infer` compares across world sizes: every output, as written (rank 0's)
    mg.verify.record("outputs", list(outputs) if outputs is not None else None)
    written = []
    if mg.is_main():
        named = cfg.output is not None and not Path(output).exists()  # a folder the user named: made with their umask
        Path(output).mkdir(parents=True, exist_ok=True)
        for path, out in zip(inputs, outputs, strict=False):
            target = io.output_path(output, path)
            io.write_image(target, out, source=path)
            written.append(str(user_made(target) if cfg.output is not None else target))
        if named:
            user_made(output)
    ndim = images[0].dim() - 2
    num_windows = WindowPlan([im.shape[2:] for im in images], as_tuple(cfg.roi, ndim, "roi"),
                             as_tuple(cfg.overlap, ndim, "overlap")).num_windows
    summary = run.close({"num_images": len(images), "num_windows": num_windows, "outputs": written,
                         "total_s": seconds})
    if mg.is_main():
        write_json_atomic(run_dir / "outputs.json", {"outputs": written})
        print(f"[multigpu infer] {num_windows} windows of {len(images)} image(s) on {summary['world_size']} "
              f"rank(s) in {seconds:.1f} s ({summary['throughput']:.1f} windows/s after the first batch); "
              f"wrote {', '.join(written)}", flush=True)
    return 0



def _dry_run(cfg, plan, rank: int, report) -> None:
    """``--dry-run``'s part of this workload, as rank ``rank`` would run it (:mod:`multigpu.infer.dryrun`)."""
    from multigpu.infer.dryrun import examine

    examine(cfg, plan, rank, report)

WORKLOAD = Workload(
    name="infer",
    config=InferConfig,
    check=check,
    main=main,
    dry_run=_dry_run,
    help="blend a model's output over overlapping windows of large images, on every rank",
    prefix="infer",
    flags=(
        Flag("--model", "model.factory", metavar="PKG.MODULE:FACTORY",
             help="model factory, e.g. multigpu.infer.models:denoiser (or :edges, :upsample2x)"),
        Flag("--model-arg", "model.kwargs", action="append", metavar="NAME=VALUE",
             help="an argument of the model factory, repeatable (the same as model.kwargs.NAME=VALUE)"),
        Flag("--call-arg", "call_kwargs", action="append", metavar="NAME=VALUE",
             help="an extra argument of every model call, repeatable, e.g. sigma=0.05 for a DRUNet"),
        Flag("--input", "inputs", nargs="+", metavar="IMAGE",
             help="PNG/JPEG/BMP/TIFF images, .npy arrays or NIfTI .nii/.nii.gz volumes (2-D or 3-D; sizes may "
                  "differ); default: the noisy demo photo"),
        Flag("--output", "output", metavar="DIR", help="folder for the outputs (default: out/ in the run directory)"),
        Flag("--roi", "roi", nargs="+", type=positive_int, metavar="N", help="window size: one value, or one per dim: H W (D H W for 3-D volumes) (default 256)"),
        Flag("--overlap", "overlap", nargs="+", type=float, metavar="F",
             help="overlap fraction in [0, 1): one value or per dim (default 0.25)"),
        Flag("--batch-size", "batch_size", type=positive_int, help="windows per model call (default 8)"),
        Flag("--blend", "blend", choices=("constant", "gaussian", "crop"), help="default gaussian"),
        Flag("--sigma-scale", "sigma_scale", type=positive_float, help="Gaussian sigma / roi (default 0.125)"),
        Flag("--precision", "precision", choices=("fp32", "bf16", "fp16"), help="default fp32"),
        Flag("--pad-mode", "pad_mode", choices=("constant", "reflect", "replicate", "circular"),
             help="padding of images smaller than the roi (default constant)"),
    ),
    bench=("roi=[128]", "batch_size=4"),
)
