"""What follows the target in ``multigpu bench`` and ``multigpu verify`` (runs in the launcher).

    multigpu bench train --nproc 1,2 -f nano steps=3
    multigpu verify --nproc 1,2 train --rtol 0.01 eval_every=20 --cpu

For a workload (a built-in name or ``pkg.module:WORKLOAD``), what follows its name is read as
``multigpu <workload>`` reads it (``-f``, ``--set``, its shortcut flags, ``key=value``), together with the
command's own flags and the launcher's, in any order; a flag given after the name wins over the same flag
given before it (lists, such as ``--set``, add up). What follows a script stays the script's own arguments,
as with torchrun.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

__all__ = ["add_config_flags", "merge_workload_line", "require_nproc", "target_from_args"]


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """``-f`` and ``--set`` before the target (a workload's, also taken after its name)."""
    parser.add_argument("-f", "--config", metavar="FILE|PRESET", default=None,
                        help="a workload's YAML config: a path or a packaged preset name (default: its preset)")
    parser.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a workload's config override, repeatable (the same as a key=value after its name)")


def _workload(args: argparse.Namespace):
    from multigpu.jobs.registry import get_workload, is_workload_spec

    if args.module or Path(args.target).is_file() or not is_workload_spec(args.target):
        return None
    return get_workload(args.target)


def merge_workload_line(args: argparse.Namespace, command: str,
                        add_own: Callable[[argparse.ArgumentParser], None]) -> None:
    """For a workload target, parse ``args.args`` as its command line (plus ``add_own``'s flags and the
    launcher's) into ``args``; for a script, leave them as its arguments. Bad input: UsageError (exit 2)."""
    workload = _workload(args)
    if workload is None:
        return
    from multigpu.cmdline import ArgumentParser, parse
    from multigpu.jobs.command import add_config_flags as add_workload_config_flags
    from multigpu.jobs.command import add_overrides_arg, add_workload_flags
    from multigpu.launch.flags import add_launch_flags

    parser = ArgumentParser(prog=f"multigpu {command} {args.target}",
                            description=f"multigpu {command} on the {workload.name} workload: its command line "
                                        f"as `multigpu {workload.name}` takes it, with {command}'s flags")
    add_own(parser)
    add_workload_config_flags(parser, workload)
    add_workload_flags(parser, workload)
    add_launch_flags(parser)
    for action in parser._actions:  # only what was given after the name lands in `later`
        if not isinstance(action, argparse._HelpAction):
            action.default = argparse.SUPPRESS
    add_overrides_arg(parser, workload)
    later = parse(parser, list(args.args))
    for name, value in vars(later).items():
        before = getattr(args, name, None)
        setattr(args, name, before + value if isinstance(value, list) and isinstance(before, list) else value)
    args.args = []


def require_nproc(args: argparse.Namespace, command: str, example: str) -> None:
    """``--nproc`` was given (before the target, or after a workload's name)."""
    from multigpu.errors import UsageError

    if args.nproc is None:
        where = "" if _workload(args) else f" before the script (what follows {args.target} is its own arguments)"
        raise UsageError(f"--nproc is required{where}: the world sizes to {command}, e.g. --nproc {example}")


def target_from_args(args: argparse.Namespace, launch_cfg):
    """The :class:`~multigpu.bench.Target` of a parsed bench/verify command line (after :func:`merge_workload_line`)."""
    from multigpu.bench import resolve_target
    from multigpu.errors import ConfigError

    workload = _workload(args)
    if workload is None:
        if args.set_overrides:
            raise ConfigError(f"--set {args.set_overrides[0]} is a workload's config override, and {args.target} is a "
                         "script: give its own arguments after its path")
        return resolve_target(args.target, list(args.args), module=args.module, config=args.config)
    from multigpu.jobs.command import flag_values, overrides_from_args

    return resolve_target(args.target, overrides_from_args(workload, args, launch_cfg), config=args.config,
                          flags=flag_values(workload, args))

