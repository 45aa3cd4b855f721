"""``multigpu launch``: start a script on every selected device (runs in the launcher).

    multigpu launch --gpus all train.py --lr 3e-4
    multigpu launch --nproc-per-node 2 examples/hello.py        # 2 CPU ranks where there is no GPU
    multigpu launch --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 train.py
"""

from __future__ import annotations

import argparse

from multigpu.launch.flags import add_launch_flags, config_from_args

HELP = "run a script on every selected GPU (or CPU ranks) through torchrun's agent"


def add_target_args(parser: argparse.ArgumentParser, *, metavar: str = "script.py",
                    help: str = "the script (or, with -m, the module) to run") -> None:
    """``[-m] target [args...]``, shared by every command that runs a user's script (launch, bench, verify)."""
    parser.add_argument("-m", "--module", action="store_true", help="run the target as a module (python -m)")
    parser.add_argument("target", metavar=metavar, help=help)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("launch", help=HELP, description=HELP)
    add_launch_flags(parser)
    add_target_args(parser)
    return parser


def run(args: argparse.Namespace) -> int:
    from multigpu.launch.agent import launch

    launch(config_from_args(args), args.target, args.args, module=args.module)
    return 0
