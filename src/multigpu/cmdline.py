"""argparse pieces that every command line shares (runs in the launcher).

Below the command line (:mod:`multigpu.cli`), the job contract's parser
(:mod:`multigpu.jobs.command`) and the launcher flags
(:mod:`multigpu.launch.flags`): it imports nothing of ours but
:mod:`multigpu.errors`, so none of those has to import another to build a parser.
"""

from __future__ import annotations

import argparse

from multigpu.errors import UsageError

__all__ = ["ArgumentParser", "add_flag", "parse", "script_args", "split_script_args"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`UsageError` (one line, exit 2) instead of printing usage.

    Abbreviated flags are off (``allow_abbrev=False``): ``--nnod`` is not ``--nnodes``, and a script's own
    ``--n 5`` is never read as an ambiguous prefix of ours. A flag is spelled out or it is not ours.
    """

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")

    def _get_values(self, action, arg_strings):  # type: ignore[override]
        # Python 3.10/3.11 argparse drops a lone "--" value ("--node-rank=--") and returns [] for a
        # single-valued option, which then reaches our configs as a list: reject it here instead.
        if action.nargs is None and action.option_strings and arg_strings == ["--"]:
            raise argparse.ArgumentError(action, "expected one value, got '--'")
        return super()._get_values(action, arg_strings)


def add_flag(parser, *names: str, **kwargs) -> argparse.Action:
    """Add a dashed flag with its underscore alias (``--nproc-per-node`` and ``--nproc_per_node``)."""
    aliases = list(names)
    for name in names:
        if name.startswith("--") and "-" in name[2:]:
            aliases.append("--" + name[2:].replace("-", "_"))
    return parser.add_argument(*aliases, **kwargs)


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


def script_args(args: argparse.Namespace) -> list[str]:
    """The arguments that belong to the user's script (everything after it), of a command that runs one."""
    return list(args.args) if hasattr(args, "target") and isinstance(getattr(args, "args", None), list) else []


def split_script_args(args: argparse.Namespace, argv: list[str]) -> tuple[list[str], list[str]]:
    """``argv`` as (ours, the script's): everything after the script is the script's, verbatim, and nothing in
    it is read as a launcher flag (argparse's REMAINDER takes it whole)."""
    tail = script_args(args)
    head = argv[: len(argv) - len(tail)]
    return head, argv[len(head):]
