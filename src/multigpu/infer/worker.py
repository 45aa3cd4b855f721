"""Rank entry point of ``multigpu infer`` (runs inside each rank, started by the launcher).

    python -m multigpu.infer.worker RUN_DIR/resolved_config.json   # normally via `multigpu infer`
    multigpu bench --nproc 1,2 infer roi=[256]                    # the demo denoiser on the demo photo

Every rank reads every input image, builds the model, and calls
``sliding_window``; rank 0 writes one output per input (atomically) and the
step meter's ``summary.json`` (windows/s) into the run directory. Under weak
scaling (``MULTIGPU_SCALING=weak``) the list of images is repeated
``problem_scale()`` times; only the first copy's outputs are written.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

import multigpu as mg
from multigpu.config import apply_overrides, from_dict
from multigpu.errors import ConfigError
from multigpu.infer import io
from multigpu.infer.config import InferConfig
from multigpu.infer.runner import sliding_window
from multigpu.infer.windows import WindowPlan, as_tuple
from multigpu.monitor import StepMeter, problem_scale, run_dir_from_env, write_json_atomic

__all__ = ["load_model", "main"]


def load_model(spec: str) -> nn.Module:
    """Import ``package.module:factory`` and call the factory; one-line ConfigError on any failure."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - an import can fail in any way
        raise ConfigError(f"--model {spec!r}: module '{module_name}' does not import "
                          f"({type(exc).__name__}: {exc}); give package.module:factory") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise ConfigError(f"--model {spec!r}: '{module_name}' has no callable '{attr}'; callables there: "
                          f"{', '.join(names[:12]) or 'none'}")
    try:
        model = factory()
    except Exception as exc:  # noqa: BLE001
        raise ConfigError(f"--model {spec!r}: calling {attr}() failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(model, nn.Module) and not callable(model):
        raise ConfigError(f"--model {spec!r}: {attr}() returned {type(model).__name__}, not a model")
    return model


def _load(argv: list[str]) -> InferConfig:
    """A resolved JSON config (from `multigpu infer`), or key=value overrides of a benchmark default
    (from `multigpu bench infer`): the demo denoiser on the noisy demo photo, in ``$MULTIGPU_RUN_DIR``."""
    if argv and argv[0].endswith(".json"):
        return from_dict(InferConfig, json.loads(Path(argv[0]).read_text()))
    from multigpu.infer.models import noisy_demo_image

    run_dir = run_dir_from_env() or Path("runs/infer/bench")
    image = run_dir.parent / "bench_input.png"
    if mg.rank() == 0 and not image.exists():
        noisy_demo_image(image)
    mg.barrier()
    defaults = {"model": "multigpu.infer.models:denoiser", "inputs": [str(image)], "output": str(run_dir / "out"),
                "roi": [128], "batch_size": 4, "run_dir": str(run_dir)}
    return from_dict(InferConfig, apply_overrides(defaults, argv))


def main(argv: list[str]) -> int:
    mg.init()
    cfg = _load(argv)
    model = load_model(cfg.model)
    if isinstance(model, nn.Module):
        model = model.to(mg.device()).eval()
    images = [io.read_image(p) for p in cfg.inputs] * problem_scale()
    meter = StepMeter("windows", total_steps=None, description="infer", run_dir=cfg.run_dir)
    start = time.perf_counter()
    outputs = sliding_window(images, model, cfg.roi, cfg.overlap, cfg.batch_size, cfg.blend, cfg.precision,
                             cfg.pad_mode, sigma_scale=cfg.sigma_scale, meter=meter)
    seconds = time.perf_counter() - start
    written = []
    if mg.is_main():
        for path, out in zip(cfg.inputs, outputs, strict=False):
            target = io.output_path(cfg.output, path)
            io.write_image(target, out)
            written.append(str(target))
    ndim = images[0].dim() - 2
    num_windows = WindowPlan([im.shape[2:] for im in images], as_tuple(cfg.roi, ndim, "roi"),
                             as_tuple(cfg.overlap, ndim, "overlap")).num_windows
    summary = meter.close({"num_images": len(images), "num_windows": num_windows, "outputs": written,
                           "total_s": seconds})
    if mg.is_main():
        write_json_atomic(Path(cfg.run_dir) / "outputs.json", {"outputs": written})
        print(f"[multigpu infer] {num_windows} windows of {len(images)} image(s) on {summary['world_size']} "
              f"rank(s) in {seconds:.1f} s ({summary['throughput']:.1f} windows/s after the first batch); "
              f"wrote {', '.join(written)}", flush=True)
    mg.shutdown()
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main(sys.argv[1:]))
