"""The ``multigpu`` command line (runs outside the ranks, once per node).

``main()`` builds one subparser per command module (each has ``add_parser``
and ``run``), and is the single place that maps our errors to one line on
stderr and the error's exit code (2 for bad input; 130 for Ctrl-C; 128 + N
for another signal N, e.g. 143 for SIGTERM). ``--debug`` (or
``MULTIGPU_DEBUG=1``) shows the traceback instead, in the launcher and in the
workers (it sets ``MULTIGPU_DEBUG=1`` for them).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
from collections.abc import Sequence

from multigpu.argtypes import non_negative_int, positive_float, positive_int
from multigpu.errors import MultigpuError, UsageError

__all__ = ["COMMANDS", "ArgumentParser", "main", "non_negative_int", "positive_float", "positive_int"]

COMMANDS = ["launch", "info", "train", "sim", "infer", "rl", "run", "bench", "verify", "doctor", "report"]
"""Commands in ``--help`` order: a module under ``multigpu.cli``, or a workload of :data:`WORKLOAD_COMMANDS`."""

WORKLOAD_COMMANDS = ("train", "sim", "infer", "rl")
"""Built-in workloads that are commands; each goes through the one job contract (:mod:`multigpu.jobs.command`)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` (one line, exit 2) instead of printing usage."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def _get_values(self, action, arg_strings):  # type: ignore[override]
        # Python 3.10/3.11 argparse drops a lone "--" value ("--node-rank=--") and returns [] for a
        # single-valued option, which then reaches our configs as a list: reject it here instead.
        if action.nargs is None and action.option_strings and arg_strings == ["--"]:
            raise argparse.ArgumentError(action, "expected one value, got '--'")
        return super()._get_values(action, arg_strings)


def add_flag(parser: argparse.ArgumentParser, *names: str, **kwargs) -> argparse.Action:
    """Add a dashed flag with its underscore alias (``--nproc-per-node`` and ``--nproc_per_node``)."""
    aliases = list(names)
    for name in names:
        if name.startswith("--") and "-" in name[2:]:
            aliases.append("--" + name[2:].replace("-", "_"))
    return parser.add_argument(*aliases, **kwargs)


def build_parser(only: str | None = None) -> ArgumentParser:
    """The whole command line; with ``only`` (a command name) just that command's subparser.

    Building a workload's subparser imports the workload's module (its config class gives the flags), so
    building all of them imports every workload (the simulation's pulls in torch.distributed.checkpoint and
    DTensor: seconds of start-up). ``main`` builds only the command it was given (``_command_of``).
    """
    parser = ArgumentParser(
        prog="multigpu",
        description="Run a PyTorch workload on every GPU of one machine or many, and measure what it gained.",
    )
    parser.add_argument("--debug", action="store_true", default=False, help="show Python tracebacks on errors")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ArgumentParser)
    for name in COMMANDS:
        if only is not None and name != only:
            continue
        if name in WORKLOAD_COMMANDS:
            from multigpu.jobs.command import add_workload_parser, run_command
            from multigpu.jobs.registry import builtin

            workload = builtin(name)
            command = add_workload_parser(sub, workload)
            command.set_defaults(_run=functools.partial(run_command, workload))
        else:
            module = importlib.import_module(f"multigpu.cli.{name}")
            command = module.add_parser(sub)
            command.set_defaults(_run=module.run)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``parse_args``, except that a workload command's ``key=value`` overrides may stand anywhere, between flags
    too (``multigpu train steps=9 --nproc-per-node 2 lr=1e-3``): argparse takes one run of positionals only."""
    args, extra = parser.parse_known_args(argv)
    if extra and isinstance(getattr(args, "overrides", None), list):
        stray = [e for e in extra if "=" not in e or e.startswith("-")]
        if not stray:
            args.overrides += extra
            return args
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (its first word not starting with "-"), when it is one; else None.

    The top-level options (--debug, --version, --help) take no value, so the first other word is the command.
    None (a typo, no command, --help) makes ``main`` build every subparser, so the usage and the list of
    valid commands are complete.
    """
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in COMMANDS else None


def _version() -> str:
    from multigpu import __version__

    return f"multigpu {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``multigpu`` console script. Returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("MULTIGPU_DEBUG") == "1"
    if debug and os.environ.get("MULTIGPU_DEBUG") != "1":
        os.environ["MULTIGPU_DEBUG"] = "1"  # for the workers too (their Ctrl-C tracebacks); put back below
        try:
            return main(argv)
        finally:
            os.environ.pop("MULTIGPU_DEBUG", None)
    try:
        args = parse(build_parser(_command_of(argv)), argv)
        if getattr(args, "_run", None) is None:
            build_parser().print_help()
            return 2
        return int(args._run(args) or 0)
    except MultigpuError as exc:
        if debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - the one top-level handler
        if debug:
            raise
        print(f"error: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
