"""``multigpu doctor``: check this machine's setup for multi-GPU jobs (runs in the launcher).

    multigpu doctor                    # a table: pass / warn / fail, what was found, what to do
    multigpu doctor --json             # the same as JSON, with the facts behind it
    multigpu doctor --skip-bandwidth   # without the few-seconds all-reduce test

Exit code 1 when any check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

HELP = "check drivers, backends, device variables, shared memory, ports, network and all-reduce bandwidth"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.cmdline import add_flag

    parser = subparsers.add_parser("doctor", help=HELP, description=HELP)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_flag(parser, "--skip-bandwidth", action="store_true", help="skip the short all-reduce bandwidth test")
    return parser


def run(args: argparse.Namespace) -> int:
    from multigpu.doctor import gather_facts, run_checks

    facts = gather_facts(bandwidth=not args.skip_bandwidth)
    results = run_checks(facts)
    failed = any(r.status == "fail" for r in results)
    if args.json:
        print(json.dumps({"ok": not failed, "checks": [dataclasses.asdict(r) for r in results],
                          "facts": dataclasses.asdict(facts)}, indent=2))
        return 1 if failed else 0
    from rich.markup import escape
    from rich.table import Table

    from multigpu.cli.bench import console as make_console

    style = {"pass": "green", "warn": "yellow", "fail": "bold red"}
    table = Table(title="multigpu doctor")
    for column in ("check", "status", "found", "what to do"):
        table.add_column(column, overflow="fold")
    for r in results:
        table.add_row(escape(r.name), f"[{style[r.status]}]{r.status}[/]", escape(r.detail), escape(r.hint))
    console = make_console()
    console.print(table)
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "warn", "fail")}
    console.print(f"{counts['pass']} passed, {counts['warn']} warnings, {counts['fail']} failed")
    return 1 if failed else 0
