"""The ``multigpu`` command line (runs outside the ranks, once per node).

``main()`` builds one subparser per command: a tool module of :data:`TOOLS`
(each has ``add_parser`` and ``run``), or a built-in workload, whose parser
the job contract builds from its ``Workload`` entry (:mod:`multigpu.jobs`). It is the single place that maps our errors to one line on
stderr and the error's exit code (2 for bad input; 130 for Ctrl-C; 128 + N
for another signal N, e.g. 143 for SIGTERM). ``--debug`` (or
``MULTIGPU_DEBUG=1``) shows the traceback instead, in the launcher and in the
workers (it sets ``MULTIGPU_DEBUG=1`` for them).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import os
import sys
from collections.abc import Sequence

from multigpu import envvars
from multigpu.cmdline import ArgumentParser, parse
from multigpu.errors import MultigpuError

__all__ = ["TOOLS", "build_parser", "commands", "main"]

TOOLS = ("launch", "info", "run", "bench", "verify", "plan", "doctor", "report")
"""The commands that are modules under ``multigpu.cli`` (each has ``add_parser`` and ``run``); the others are the
built-in workloads that are commands (:func:`multigpu.jobs.registry.commands`: their ``Workload`` entries say so)."""


def commands() -> list[str]:
    """Every command, in ``--help`` order: launch, info, the built-in workloads, then the other tools.

    Imports every built-in workload (each ``Workload`` entry says whether it is a command and gives its help).
    """
    from multigpu.jobs.registry import commands as workload_commands

    return [*TOOLS[:2], *workload_commands(), *TOOLS[2:]]


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
    for name in commands() if only is None else [only]:
        if name in TOOLS:
            module = importlib.import_module(f"multigpu.cli.{name}")
            command = module.add_parser(sub)
            command.set_defaults(_run=module.run)
        else:
            from multigpu.jobs.command import add_workload_parser, run_command
            from multigpu.jobs.registry import builtin

            workload = builtin(name)
            command = add_workload_parser(sub, workload)
            command.set_defaults(_run=functools.partial(run_command, workload), _workload=workload)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


def _command_of(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names (its first word not starting with "-"), when it is one; else None.

    The top-level options (--debug, --version, --help) take no value, so the first other word is the command.
    None (a typo, no command, --help) makes ``main`` build every subparser, so the usage and the list of
    valid commands are complete. Only a built-in workload's name imports that one workload (to ask its entry).
    """
    first = next((a for a in argv if not a.startswith("-")), None)
    if first is None or first in TOOLS:
        return first
    from multigpu.jobs.registry import is_command

    return first if is_command(first) else None


def _launches(argv: Sequence[str]) -> bool:
    """Whether ``argv``'s command may start workers (the fork server is made only for those)."""
    first = next((a for a in argv if not a.startswith("-")), None)
    return first is not None and first not in ("info", "doctor", "report", "plan") and "--help" not in argv \
        and "-h" not in argv


def _version() -> str:
    from multigpu import __version__

    return f"multigpu {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``multigpu`` console script. Returns the exit code.

    ``--debug`` counts only where it is ours: after a script it is the script's argument.
    """
    from multigpu import _startup
    from multigpu.cmdline import split_script_args

    if argv is None:  # this process was started for this command (the console script, python -m multigpu)
        # what is imported by now (torch) lives as long as the process: frozen, the collections at its exit skip
        # it (~0.4 CPU-seconds after a job ended)
        gc.freeze()
        # each line out at once, as on a terminal: under a scheduler stdout is a pipe (SLURM's .out file), and the
        # ranks' lines the launcher copies there waited in an 8 KiB buffer until it exited (or were lost with it)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, ValueError, OSError):  # replaced or closed by an embedder
                stream.reconfigure(line_buffering=True)
        if _launches(sys.argv[1:]):
            from multigpu.launch import forkserver

            forkserver.start()  # the workers' copy of this process, taken before anything else happens here
    _startup.restore()  # a Ctrl-C from here on is KeyboardInterrupt, answered below with one line
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(envvars.DEBUG) == "1"
    try:
        args = parse(build_parser(_command_of(argv)), argv)
    except MultigpuError as exc:
        return _failed(exc, debug or "--debug" in argv)
    except KeyboardInterrupt:  # a Ctrl-C while the command's own modules still import (a loaded machine: seconds)
        return _interrupted()
    ours, theirs = split_script_args(args, argv)
    if "--debug" in ours and not debug:
        os.environ[envvars.DEBUG] = "1"  # for the workers too (their Ctrl-C tracebacks); put back below
        try:
            return _run(args, ours, theirs, debug=True)
        finally:
            os.environ.pop(envvars.DEBUG, None)
    return _run(args, ours, theirs, debug=debug)


def print_job_file(args: argparse.Namespace, ours: list[str], theirs: list[str] = ()) -> bool:
    """``--print-sbatch`` / ``--print-k8s``: print the job file for this command (nothing is launched) and say
    True; else False. ``ours``: the command line up to the script; ``theirs``: the script's arguments."""
    from multigpu.launch.flags import scheduler_file

    script = scheduler_file(args, [a for a in ours if a != "--debug"], list(theirs))
    if script is None:
        return False
    if args.print_k8s:  # it holds the job's rendezvous secret: a file it is written to is this user's only
        _private_stdout()
    print(script, end="")
    return True


def _private_stdout() -> None:
    """Make standard output this user's only (0600) when it is a regular file of theirs (``> job.yaml``)."""
    import stat

    try:
        info = os.fstat(sys.stdout.fileno())
        if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid():
            os.fchmod(sys.stdout.fileno(), 0o600)
    except (OSError, ValueError, AttributeError):  # no real file descriptor (captured output): nothing to protect
        pass


def _failed(exc: MultigpuError, debug: bool) -> int:
    if debug:
        raise exc
    print(f"error: {exc}", file=sys.stderr)
    return exc.exit_code


def _interrupted() -> int:
    """The answer to a Ctrl-C, wherever the command was: one line, exit code 130 (128 + SIGINT)."""
    print("error: interrupted", file=sys.stderr)
    return 130


def _run(args: argparse.Namespace, ours: list[str], theirs: list[str], *, debug: bool) -> int:
    try:
        if getattr(args, "_run", None) is None:
            build_parser().print_help()
            return 2
        if print_job_file(args, ours, theirs):
            return 0
        from multigpu.files import private_files

        args._argv = [a for a in ours if a != "--debug"] + theirs  # the command as typed (a resume line repeats it)
        with private_files():  # what the command and its ranks write is this user's only (0700 / 0600)
            return int(args._run(args) or 0)
    except MultigpuError as exc:
        return _failed(exc, debug)
    except KeyboardInterrupt:
        return _interrupted()
    except Exception as exc:  # noqa: BLE001 - the one top-level handler
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if isinstance(exc, SignalException):
            # the launcher's signal raised outside the agent's stop (a second SIGTERM while the job ends): the
            # same answer as inside it, not an internal error (a scheduler requeues on 143, not on 1)
            from multigpu.launch.agent import stopped_by

            stop = stopped_by(exc.sigval)
            return _interrupted() if isinstance(stop, KeyboardInterrupt) else _failed(stop, debug)
        if debug:
            raise
        print(f"error: internal error: {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1
