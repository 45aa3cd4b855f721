"""``multigpu train``: data-parallel training of the nano GPT through the launcher (runs in the launcher).

    multigpu train -f configs/nano.yaml --nproc-per-node 2             # 2 CPU ranks where there is no GPU
    multigpu train -f configs/nano.yaml --gpus all --precision bf16 --grad-accum 4
    multigpu train -f configs/nano.yaml --resume auto steps=400        # continue the newest run, longer

Everything is validated here, before a rank is spawned or a file written:
config keys and values, the batch split over the job's world size, the
precision on the job's device, the sync backend, the data path, the resume
file. Then the run directory gets ``resolved_config.json`` and the workers run
``multigpu.train.worker`` on it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from multigpu.errors import ConfigError

HELP = "train the built-in character-level GPT on every selected GPU (or CPU ranks)"
RUNS = Path("runs") / "train"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.cli import add_flag, non_negative_int, positive_int
    from multigpu.cli.launch import add_launch_flags

    parser = subparsers.add_parser("train", help=HELP, description=HELP)
    parser.add_argument("-f", "--config", metavar="FILE", help="YAML config (e.g. configs/nano.yaml); default: built-in")
    t = parser.add_argument_group("training")
    add_flag(t, "--sync-backend", choices=["auto", "nccl", "gloo", "cpu"], help="gradient all-reduce backend")
    add_flag(t, "--precision", choices=["fp32", "bf16", "fp16"], help="autocast precision")
    add_flag(t, "--dtype", choices=["fp32", "bf16", "fp16"], help="the model's parameter dtype")
    add_flag(t, "--grad-accum", type=positive_int, help="gradient accumulation steps (see grad_accum_scope)")
    add_flag(t, "--prefetch", type=non_negative_int, help="batches moved to the device ahead of use")
    add_flag(t, "--resume", metavar="auto|PATH", help="continue from the newest checkpoint (auto) or a file")
    add_flag(t, "--run-dir", metavar="DIR", help=f"output folder (default {RUNS}/<timestamp>)")
    add_flag(t, "--checkpoint-on-interrupt", action="store_true", default=None,
             help="on Ctrl-C, finish the current step and write a checkpoint before stopping")
    add_launch_flags(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=400 model.n_layer=6")
    return parser


def _flag_overrides(args: argparse.Namespace) -> list[str]:
    pairs = [("sync_backend", args.sync_backend), ("precision", args.precision), ("dtype", args.dtype),
             ("grad_accum", args.grad_accum), ("prefetch", args.prefetch), ("resume", args.resume),
             ("checkpoint_on_interrupt", args.checkpoint_on_interrupt)]
    return [f"{key}={value}" for key, value in pairs if value is not None]


def _latest_run(resume: str | None, run_dir: str | None) -> Path | None:
    """With ``--resume auto`` and no ``--run-dir``: the newest run under runs/train that has a checkpoint."""
    if resume != "auto" or run_dir is not None or not RUNS.is_dir():
        return None
    runs = sorted((p for p in RUNS.iterdir() if any((p / "checkpoints").glob("ckpt_*.pt"))), key=lambda p: p.name)
    return runs[-1] if runs else None


def _fresh_run_dir() -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = RUNS / stamp, 1
    while path.exists():  # two runs started within the same second
        n += 1
        path = RUNS / f"{stamp}-{n}"
    return path


def _check_resume_file(resume: str) -> None:
    """``--resume PATH`` must name an intact checkpoint (size and SHA-256 as its manifest records)."""
    from multigpu.checkpointing import CorruptCheckpointError
    from multigpu.train.checkpoint import check_checkpoint

    if not Path(resume).is_file():
        raise ConfigError(f"--resume {resume}: no such file; valid: auto, or the path of a checkpoints/ckpt_*.pt")
    try:
        check_checkpoint(resume)
    except CorruptCheckpointError as exc:
        raise ConfigError(f"--resume {resume}: {exc.reason}; valid: an intact checkpoint, or auto "
                          "(the newest valid one)") from None


def validate(cfg, launch_cfg) -> int:
    """Every check that needs the job's shape; returns its world size. Raises ConfigError/DeviceError."""
    from multigpu.launch.devices import HostFacts, plan_devices
    from multigpu.train.data import find_files
    from multigpu.train.precision import check_precision, probe_support
    from multigpu.train.sync import check_sync_backend

    plan = plan_devices(launch_cfg, HostFacts.probe())
    world_size = plan.nproc_per_node * launch_cfg.nnodes
    cfg.validate_for(world_size)
    device_types = (["cuda"] if plan.gpu_ids else []) + (["cpu"] if len(plan.gpu_ids) < plan.nproc_per_node else [])
    for device_type in device_types:
        check_sync_backend(cfg.sync_backend, device_type)
        check_precision(cfg.precision, cfg.dtype, probe_support(device_type))
    find_files(cfg.data)
    if cfg.resume not in (None, "auto"):
        _check_resume_file(cfg.resume)
    return world_size


def run(args: argparse.Namespace) -> int:
    from multigpu.cli.launch import config_from_args
    from multigpu.config import load_config, to_dict
    from multigpu.launch.agent import launch
    from multigpu.monitor import write_json_atomic
    from multigpu.train.config import TrainConfig

    cfg = load_config(TrainConfig, args.config, [*args.overrides, *_flag_overrides(args)])
    launch_cfg = config_from_args(args)
    world_size = validate(cfg, launch_cfg)
    previous = _latest_run(cfg.resume, args.run_dir)
    run_dir = Path(args.run_dir) if args.run_dir else previous or _fresh_run_dir()
    if previous is not None:
        print(f"multigpu train: --resume auto continues {run_dir}", flush=True)
    write_json_atomic(run_dir / "resolved_config.json", to_dict(cfg))
    print(f"multigpu train: {world_size} rank(s), run directory {run_dir}", flush=True)
    launch(launch_cfg, "multigpu.train.worker", [str(run_dir / "resolved_config.json")], module=True)
    return 0
