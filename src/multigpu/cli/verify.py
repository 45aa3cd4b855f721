"""``multigpu verify``: does the script compute the same thing at every world size? (runs in the launcher)

    multigpu verify --nproc 1,2,3 examples/verify_independent.py            # passes
    multigpu verify --nproc 1,2,3 --rtol 1e-6 train.py
    multigpu verify --nproc 1,2 --rtol 0.01 train eval_every=20   # a workload: train records val_loss when it evaluates
    multigpu verify train --nproc 1,2 -f nano eval_every=20       # after a workload: its command line, in any order

The script names its results with ``mg.verify.record(name, value)``; each run
gets its own verify folder in its run context (``<run-dir>/np<N>``) and its run folder
(``<run-dir>/runs/np<N>``: a workload's outputs, the logs), and every result is
compared with the smallest world size's. Without ``--run-dir`` all of it is in a temporary
folder, removed afterwards (kept, and named, when a run failed). Exit code 1 when any result differs
beyond ``--atol``/``--rtol`` (default 0: exact), naming it and the difference, then the script's lines that
likely cause it. Every world size runs with the same threads per rank (the cores over the largest size, unless
``--threads``): a kernel whose float result depends on its thread count must not pass for a dependence on
the world size.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

HELP = "run a script at several world sizes and compare its recorded results (mg.verify.record)"


def _tolerance(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid; valid: a number >= 0")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.cli.launch import add_target_args
    from multigpu.cli.workload_line import add_config_flags
    from multigpu.jobs.registry import BUILTIN
    from multigpu.launch.flags import add_launch_flags

    parser = subparsers.add_parser("verify", help=HELP, description=HELP)
    add_own_flags(parser)
    add_config_flags(parser)
    add_launch_flags(parser)
    add_target_args(parser, metavar="script.py|workload",
                    help="a script that calls mg.verify.record (what follows it is its own arguments), a built-in "
                         f"workload ({', '.join(BUILTIN)}) or pkg.module:WORKLOAD (what follows it is read as "
                         "`multigpu <workload>` reads it, with verify's flags, in any order)")
    return parser


def add_own_flags(parser: argparse.ArgumentParser) -> None:
    """verify's own flags (also taken after a workload's name)."""
    from multigpu.cmdline import add_flag

    parser.add_argument("--nproc", default=None, metavar="N,M,...",
                        help="world sizes to compare, e.g. 1,2,3; the smallest is the reference (required)")
    parser.add_argument("--atol", type=_tolerance, default=0.0, help="absolute tolerance (default 0: exact)")
    parser.add_argument("--rtol", type=_tolerance, default=0.0, help="relative tolerance (default 0: exact)")
    add_flag(parser, "--run-dir", "-o", default=None,
             help="keep the recorded results here (default: a temporary folder, removed afterwards)")


def run(args: argparse.Namespace) -> int:
    from multigpu.bench import Launcher, parse_nproc
    from multigpu.cli.workload_line import merge_workload_line, require_nproc, target_from_args
    from multigpu.errors import ConfigError, MultigpuError
    from multigpu.launch.devices import configs_for
    from multigpu.launch.flags import config_from_args
    from multigpu.verify.compare import compare, tolerance_hint

    merge_workload_line(args, "verify", add_own_flags)
    if args.nproc_per_node != "auto":
        raise ConfigError("verify sets the world size itself: use --nproc 1,2,3 instead of --nproc-per-node")
    require_nproc(args, "verify", "1,2")
    sizes = parse_nproc(args.nproc)
    if len(sizes) < 2:
        raise ConfigError(f"--nproc {args.nproc} names one world size; verify compares several, e.g. --nproc 1,2")
    from multigpu.launch import rundir

    asked = config_from_args(args)
    launch_cfg = same_threads(asked, sizes)
    target = target_from_args(args, launch_cfg)
    launcher = Launcher(target, configs_for(launch_cfg, sizes))
    if args.run_dir:
        rundir.refuse_used(args.run_dir, hint="give a new folder")
        rundir.check_free_space(args.run_dir)
    if launch_cfg.threads != asked.threads:  # chosen here: said once the command is valid
        print(f"multigpu verify: {launch_cfg.threads} thread(s) per rank at every world size (--threads to choose)",
              file=sys.stderr, flush=True)
    root = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="multigpu_verify_"))
    try:
        results = _run_sizes(launcher, sizes, root)
    except BaseException:
        if not args.run_dir:  # its logs are what the error names: kept
            print(f"multigpu verify: its runs are kept in {root}", file=sys.stderr)
        raise
    if not args.run_dir:
        shutil.rmtree(root, ignore_errors=True)
    if not any(results.values()):
        raise MultigpuError(f"{args.target} recorded no result at any world size: "
                            "call mg.verify.record(name, value) for what should not depend on the world size")
    comparisons = compare(results, atol=args.atol, rtol=args.rtol)
    _print(comparisons, args.atol, args.rtol)
    failed = [c for c in comparisons if not c.passed]
    if failed:
        first = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        hint = tolerance_hint(failed)
        if hint is None:
            _print_causes(target)
        hint = f"; it would pass with {hint}" if hint else ""
        raise MultigpuError(f"verify failed: {first.describe()} (atol {args.atol:g}, rtol {args.rtol:g}){more}{hint}")
    names = sorted({c.name for c in comparisons})
    print(f"verify passed: {len(names)} result(s) equal at {', '.join(map(str, sizes))} ranks "
          f"(atol {args.atol:g}, rtol {args.rtol:g})")
    return 0


def same_threads(cfg, sizes: tuple[int, ...]):
    """The launch config with one thread count per rank for every world size (unless ``--threads`` or
    ``OMP_NUM_THREADS`` gives one): the cores over the largest size. The float result of some kernels (oneDNN's
    convolutions on some CPUs) depends on how many threads split its sums; with the cores // N of each size, that
    would pass for a dependence on the world size."""
    import dataclasses
    import os

    from multigpu.runtime.env import cpu_count

    if cfg.threads is not None or os.environ.get("OMP_NUM_THREADS"):
        return cfg
    return dataclasses.replace(cfg, threads=max(1, cpu_count() // max(sizes)))


def _print_causes(target) -> None:
    """After a FAIL beyond float noise: the script's lines that make a result depend on the world size, else what
    to check."""
    from multigpu.verify.causes import CHECKS, likely_causes

    causes = []
    if not target.workload and not target.module:
        try:
            causes = likely_causes(Path(target.target).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            causes = []
    if causes:
        print(f"likely causes, seen in {target.target}:")
        for cause in causes:
            print(f"  - {cause.describe(target.target)}")
    else:
        print("what to check (no line of the script shows a cause):" if not target.workload else "what to check:")
        for check in CHECKS:
            print(f"  - {check}")


def _run_sizes(launcher, sizes: tuple[int, ...], root: Path) -> dict[int, dict]:
    """Run at every world size, each with its verify folder ``root/np<N>`` and its run folder ``root/runs/np<N>``
    (a workload's outputs, a script's logs); the recorded results by world size."""
    from multigpu.launch import rundir
    from multigpu.runtime.context import RunContext
    from multigpu.verify import load_results

    results = {}
    with rundir.hold(root, fresh_only=True, hint="give a new folder"):
        for n in sizes:
            folder = root / f"np{n}"
            print(f"multigpu verify: {n} rank(s) -> {folder}", file=sys.stderr, flush=True)
            launcher(n, RunContext(verify_dir=str(folder.resolve()), run_dir=str((root / "runs" / f"np{n}").resolve())))
            results[n] = load_results(folder) if folder.is_dir() else {}
    return results


def _print(comparisons, atol: float, rtol: float) -> None:
    from rich.markup import escape
    from rich.table import Table

    from multigpu.cli.bench import console

    table = Table(title=f"multigpu verify (atol {atol:g}, rtol {rtol:g})")
    for name in ("result", "ranks", "vs", "max abs diff", "max rel diff", ""):
        table.add_column(name, justify="left" if name in ("result", "") else "right")
    for c in comparisons:
        verdict = "[green]pass[/green]" if c.passed else f"[red]FAIL[/red]{' ' + escape(c.problem) if c.problem else ''}"
        table.add_row(escape(c.name), str(c.world_size), str(c.baseline),
                      "-" if c.max_abs is None else f"{c.max_abs:.3g}",
                      "-" if c.max_rel is None else f"{c.max_rel:.3g}", verdict)
    console().print(table)
