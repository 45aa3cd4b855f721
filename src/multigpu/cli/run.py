"""``multigpu run pkg.module:WORKLOAD``: run any workload through the job contract (runs in the launcher).

    multigpu run mypkg.count:WORKLOAD -f count.yaml n=1000 --nproc-per-node 2
    multigpu run sim --agents 1_000_000                     # a built-in one, the same as `multigpu sim`

The workload object defines its config class, ``check`` and ``main``
(:class:`multigpu.jobs.Workload`); everything else — the config file and
overrides, the run directory, ``--resume``, the launcher flags — is the same
as for the built-in commands. Importing the module runs its code, as
``python -m`` would.
"""

from __future__ import annotations

import argparse

HELP = "run a workload defined anywhere (pkg.module:WORKLOAD) on every selected device"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.jobs.registry import BUILTIN

    parser = subparsers.add_parser("run", help=HELP, description=HELP, add_help=True)
    parser.add_argument("workload", metavar="pkg.module:WORKLOAD",
                        help=f"a multigpu.jobs.Workload object, or a built-in name ({', '.join(BUILTIN)})")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the workload's config, overrides and launcher flags")
    return parser


def run(args: argparse.Namespace) -> int:
    from multigpu.cmdline import ArgumentParser, parse
    from multigpu.jobs.command import add_workload_parser, run_command
    from multigpu.jobs.registry import get_workload

    workload = get_workload(args.workload)
    parser = ArgumentParser(prog="multigpu run")
    sub = parser.add_subparsers(dest="command", parser_class=ArgumentParser)
    add_workload_parser(sub, workload, name=args.workload)
    inner = parse(parser, [args.workload, *args.args])
    inner._workload = workload
    inner._argv = ["run", args.workload, *args.args]
    from multigpu.cli import print_job_file

    if print_job_file(inner, ["run", args.workload, *args.args]):
        return 0
    return run_command(workload, inner, spec=args.workload)
