"""argparse pieces that every command line shares (runs in the launcher).

Below the command line (:mod:`multigpu.cli`), the job contract's parser
(:mod:`multigpu.jobs.command`) and the launcher flags
(:mod:`multigpu.launch.flags`): it imports nothing of ours but
:mod:`multigpu.errors`, so none of those has to import another to build a parser.
"""

from __future__ import annotations

import argparse

from multigpu.errors import UsageError

__all__ = ["ArgumentParser", "add_flag", "parse"]


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
