"""``multigpu report``: one self-contained HTML page about a run or a bench (runs in the launcher).

    multigpu report runs/bench/20261122-101500                 # -> runs/bench/20261122-101500/report.html
    multigpu report runs/train/20261122-1015 -o train.html
"""

from __future__ import annotations

import argparse

HELP = "write a self-contained HTML report (config, scaling table and plots, utilization, throughput)"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("report", help=HELP, description=HELP)
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a folder written by `multigpu bench` or a workload run")
    parser.add_argument("-o", "--output", default=None, help="the HTML file (default RUN_DIR/report.html)")
    return parser


def run(args: argparse.Namespace) -> int:
    from multigpu.errors import ConfigError
    from multigpu.report import write_report

    try:
        path = write_report(args.run_dir, args.output)
    except ImportError as exc:
        raise ConfigError(str(exc)) from None
    if args.output is not None:
        from multigpu.files import user_made

        user_made(path)  # a file the user named gets their umask's mode (the command runs under 0077)
    print(f"report: {path}")
    return 0
