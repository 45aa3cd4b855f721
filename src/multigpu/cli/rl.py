"""``multigpu rl``: distributed PPO on batched environments split across ranks (runs in the launcher).

    multigpu rl -f configs/ppo-cartpole.yaml --nproc-per-node 2          # 2 CPU ranks where there is no GPU
    multigpu rl -f configs/ppo-cartpole.yaml --gpus all num_envs=4096 seed=3

Loads and validates the config here (bad input fails before anything starts),
writes ``resolved_config.json`` into the run directory, then starts
``multigpu.rl.worker`` on every rank through the launcher.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

HELP = "train a policy with PPO on environments split across ranks (DDP)"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.cli import add_flag
    from multigpu.cli.launch import add_launch_flags

    parser = subparsers.add_parser("rl", help=HELP, description=HELP)
    parser.add_argument("-f", "--config", metavar="FILE.yaml", default=None,
                        help="RL config (keys of multigpu.rl.RLConfig); default: the built-in CartPole PPO")
    add_flag(parser, "--run-dir", default=None, help="where the resolved config, metrics and summary go "
             "(default runs/rl/<timestamp>)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. num_envs=128")
    add_launch_flags(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from multigpu.cli.launch import config_from_args
    from multigpu.config import load_config, to_dict
    from multigpu.errors import ConfigError
    from multigpu.launch.agent import launch
    from multigpu.monitor import write_json_atomic
    from multigpu.rl.config import RLConfig

    if args.config is not None and not Path(args.config).is_file():
        raise ConfigError(f"config file {args.config!r} does not exist (try -f configs/ppo-cartpole.yaml)")
    cfg = load_config(RLConfig, args.config, args.overrides, prefix="rl")
    launch_cfg = config_from_args(args)  # validates the launcher flags before anything is written
    run_dir = Path(args.run_dir or Path("runs") / "rl" / time.strftime("%Y%m%d-%H%M%S"))
    resolved = run_dir / "resolved_config.json"
    write_json_atomic(resolved, {"rl": to_dict(cfg)})
    print(f"multigpu rl: {cfg.env_id}, {cfg.num_envs} envs in all, run dir {run_dir}", flush=True)
    launch(launch_cfg, "multigpu.rl.worker", [str(resolved)], module=True)
    return 0
