"""``multigpu sim``: run an agent-based simulation on every selected device (runs in the launcher).

    multigpu sim -f configs/sir.yaml --agents 10_000_000 --steps 100 --nproc-per-node 2 --strategy spatial
    multigpu sim -f configs/market.yaml params.impact=0.2 --run-dir runs/market
    multigpu sim -f configs/sir.yaml --checkpoint-every 10 --resume auto --run-dir runs/sir

The config is loaded and validated here (bad input: one line, exit 2, nothing
written or spawned), the resolved config goes to the run directory, and the
ranks start through the launcher with ``multigpu.sim.worker``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

HELP = "run an agent-based simulation (movement, sir, market) split over ranks"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.cli import add_flag, non_negative_int, positive_int
    from multigpu.cli.launch import add_launch_flags

    parser = subparsers.add_parser("sim", help=HELP, description=HELP)
    parser.add_argument("-f", "--config", default=None, help="YAML config (e.g. configs/sir.yaml)")
    add_flag(parser, "--agents", type=positive_int, default=None, help="global number of agents")
    add_flag(parser, "--steps", type=non_negative_int, default=None, help="steps to run")
    add_flag(parser, "--strategy", default=None, help="data | spatial | adaptive")
    add_flag(parser, "--sync-frequency", type=positive_int, default=None,
             help="data strategy: all-reduce fields every k steps (k > 1 is an approximation)")
    add_flag(parser, "--checkpoint-every", type=non_negative_int, default=None, help="save the state every K steps")
    add_flag(parser, "--resume", default=None, metavar="auto|PATH",
             help="auto: continue from the newest checkpoint in the run dir; or a checkpoint folder")
    add_flag(parser, "--compile", action="store_true", default=None, help="fuse kernels with torch.compile")
    add_flag(parser, "--run-dir", default=None, help="output folder (default runs/sim/<timestamp>)")
    add_launch_flags(parser)
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. params.beta=0.1")
    return parser


def resolve(args: argparse.Namespace):
    """The validated SimConfig from the file, the flags and the overrides (flags win over the file)."""
    from multigpu.config import load_config
    from multigpu.errors import ConfigError
    from multigpu.sim.config import SimConfig

    overrides = list(args.overrides)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"argument {item!r} is not a key=value override (e.g. params.beta=0.1)")
    flags = {"agents": args.agents, "steps": args.steps, "strategy": args.strategy,
             "sync_frequency": args.sync_frequency, "checkpoint_every": args.checkpoint_every,
             "compile": args.compile}
    overrides += [f"{k}={v}" for k, v in flags.items() if v is not None]
    return load_config(SimConfig, args.config, overrides, prefix="sim")


def run(args: argparse.Namespace) -> int:
    from multigpu.cli.launch import config_from_args
    from multigpu.config import to_dict
    from multigpu.errors import ConfigError
    from multigpu.launch.agent import launch
    from multigpu.monitor import write_json_atomic

    cfg = resolve(args)
    launch_cfg = config_from_args(args)
    if args.resume not in (None, "auto", "none"):
        from multigpu.checkpointing import CorruptCheckpointError
        from multigpu.sim.checkpoint import check_checkpoint

        try:  # size and SHA-256 of .metadata only: the launcher unpickles nothing
            check_checkpoint(args.resume)
        except CorruptCheckpointError as exc:
            raise ConfigError(f"--resume {args.resume}: {exc.reason}; valid: auto, or a checkpoints/step_* "
                              "folder written by multigpu sim") from None
    if isinstance(launch_cfg.nproc_per_node, int) and launch_cfg.nnodes == 1:
        cfg.check_world(launch_cfg.nproc_per_node)
    run_dir = Path(args.run_dir or f"runs/sim/{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    resolved = {"sim": to_dict(cfg), "run": {"run_dir": str(run_dir), "resume": args.resume,
                                             "profile": bool(args.profile)}}
    write_json_atomic(run_dir / "resolved_config.json", resolved)
    launch(launch_cfg, "multigpu.sim.worker", [str(run_dir / "resolved_config.json")], module=True)
    return 0
