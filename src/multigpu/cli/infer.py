"""``multigpu infer``: sliding-window inference of large images over every rank (runs in the launcher).

    multigpu infer --model multigpu.infer.models:denoiser --input big.tif --output out/ --roi 256 --overlap 0.25
    multigpu infer --model mypkg.models:sr --input a.png b.png --output out/ --blend gaussian --precision bf16 --gpus all
    multigpu infer -f infer.yaml --nproc-per-node 2 --set batch_size=16

Everything is checked here before a rank starts or a file is written: the
images (exist, readable, channels), the roi (no larger than the largest image),
the overlap, and the model (imports, takes the images' channels, returns an
integer multiple of the roi). Then the resolved config goes to the run
directory and ``multigpu.infer.worker`` is launched on every rank.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from multigpu.errors import ConfigError

HELP = "blend a model's output over overlapping windows of large images, on every rank"

_FLAG_KEYS = ("model", "inputs", "output", "roi", "overlap", "batch_size", "blend", "sigma_scale", "precision",
              "pad_mode")


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.cli import add_flag, positive_float, positive_int
    from multigpu.cli.launch import add_launch_flags

    parser = subparsers.add_parser("infer", help=HELP, description=HELP)
    parser.add_argument("-f", "--config", default=None, metavar="FILE", help="YAML file of InferConfig keys")
    parser.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                        help="model factory, e.g. multigpu.infer.models:denoiser (or :edges, :upsample2x)")
    parser.add_argument("--input", dest="inputs", nargs="+", default=None, metavar="IMAGE",
                        help="PNG/JPEG/BMP/TIFF images (sizes may differ)")
    parser.add_argument("--output", default=None, metavar="DIR", help="folder for the outputs (same stems)")
    parser.add_argument("--roi", nargs="+", type=positive_int, default=None, metavar="N",
                        help="window size: one value or H W (default 256)")
    parser.add_argument("--overlap", nargs="+", type=float, default=None, metavar="F",
                        help="overlap fraction in [0, 1): one value or per dim (default 0.25)")
    add_flag(parser, "--batch-size", type=positive_int, default=None, help="windows per model call (default 8)")
    parser.add_argument("--blend", default=None, choices=("constant", "gaussian"), help="default gaussian")
    add_flag(parser, "--sigma-scale", type=positive_float, default=None, help="Gaussian sigma / roi (default 0.125)")
    parser.add_argument("--precision", default=None, choices=("fp32", "bf16", "fp16"), help="default fp32")
    add_flag(parser, "--pad-mode", default=None, choices=("constant", "reflect", "replicate", "circular"),
             help="padding of images smaller than the roi (default constant)")
    add_flag(parser, "--run-dir", default=None, help="run directory (default runs/infer/<timestamp>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, repeatable (e.g. --set batch_size=16)")
    add_launch_flags(parser)
    return parser


def resolve_config(args: argparse.Namespace):
    """InferConfig from the file, the flags and the overrides (later wins)."""
    from multigpu.config import apply_overrides, from_dict, load_yaml
    from multigpu.infer.config import InferConfig

    data = load_yaml(args.config) if args.config else {}
    for key in _FLAG_KEYS:
        value = getattr(args, key, None)
        if value is not None:
            data[key] = value
    return from_dict(InferConfig, apply_overrides(data, args.overrides), prefix="infer")


def _first_in_channels(model) -> int | None:
    modules = model.modules() if hasattr(model, "modules") else []
    for m in modules:
        if isinstance(getattr(m, "in_channels", None), int):
            return m.in_channels
    return None


def check_inputs(cfg) -> tuple[list, int, tuple]:
    """Probe every image and the model; raise ConfigError naming the first problem."""
    import torch

    from multigpu.infer import io
    from multigpu.infer.windows import as_tuple
    from multigpu.infer.worker import load_model

    infos = [io.probe(p) for p in cfg.inputs]
    if len(cfg.roi) == 3 or len(cfg.overlap) == 3:
        raise ConfigError(f"--roi {cfg.roi} / --overlap {cfg.overlap}: images are 2-D; give one value or two (H W)")
    roi = as_tuple(cfg.roi, 2, "roi")
    as_tuple(cfg.overlap, 2, "overlap")
    largest = tuple(max(i.size[d] for i in infos) for d in range(2))
    if any(r > s for r, s in zip(roi, largest, strict=True)):
        raise ConfigError(f"--roi {' '.join(map(str, cfg.roi))} is larger than the largest input "
                          f"({largest[0]}x{largest[1]}); valid: a roi up to that size (smaller images are padded)")
    channels = {i.channels for i in infos}
    if len(channels) > 1:
        raise ConfigError("the inputs have different channel counts: "
                          + ", ".join(f"{i.path}: {i.channels}" for i in infos) + "; run them separately")
    c = infos[0].channels
    model = load_model(cfg.model)
    wanted = _first_in_channels(model)
    if wanted is not None and wanted != c:
        raise ConfigError(f"'{infos[0].path}' has {c} channel(s) but the model {cfg.model} takes {wanted}")
    try:
        with torch.inference_mode():
            out = model(torch.zeros((1, c, *roi)))
    except Exception as exc:  # noqa: BLE001 - any failure of the user's model on a test window
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"the model {cfg.model} failed on a test window of shape (1, {c}, {roi[0]}, {roi[1]}) "
                          f"(the images have {c} channel(s)): {first}") from None
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or any(o % r for o, r in zip(out.shape[2:], roi, strict=True)):
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ConfigError(f"the model {cfg.model} turned a window (1, {c}, {roi[0]}, {roi[1]}) into {shape}; "
                          "it must return (1, C_out, H*k, W*k) for a whole number k")
    if out.shape[1] not in (1, 3, 4) and any(io.output_path(cfg.output, p).suffix == ".png" for p in cfg.inputs):
        raise ConfigError(f"the model returns {out.shape[1]} channels, which PNG cannot hold; use TIFF inputs")
    out_dir = Path(cfg.output)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--output '{out_dir}' exists and is not a folder")
    return infos, c, tuple(out.shape[1:])


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from multigpu.cli.launch import config_from_args
    from multigpu.config import to_dict
    from multigpu.launch.agent import launch
    from multigpu.launch.devices import HostFacts, plan_devices
    from multigpu.monitor import write_json_atomic

    cfg = resolve_config(args)
    launch_cfg = config_from_args(args)
    plan_devices(launch_cfg, HostFacts.probe())  # a device request this machine cannot meet fails here
    check_inputs(cfg)
    run_dir = Path(args.run_dir or Path("runs") / "infer" / time.strftime("%Y%m%d-%H%M%S"))
    cfg = replace(cfg, run_dir=str(run_dir.resolve()), inputs=[str(Path(p).resolve()) for p in cfg.inputs],
                  output=str(Path(cfg.output).resolve()))
    run_dir.mkdir(parents=True, exist_ok=True)
    Path(cfg.output).mkdir(parents=True, exist_ok=True)
    resolved = run_dir / "resolved_config.json"
    write_json_atomic(resolved, to_dict(cfg))
    launch(launch_cfg, "multigpu.infer.worker", [str(resolved)], module=True)
    return 0
