"""``multigpu bench``: the scaling table for a workload, measured (runs in the launcher).

    multigpu bench --nproc 1,2 examples/allreduce_dp.py
    multigpu bench --nproc 1,2,4 --weak --repeat 3 train.py --steps 50   # after a script: its own arguments
    multigpu bench train --nproc 1,2 -f nano steps=40  # after a workload: its command line, bench's flags too
    multigpu bench --nproc 1,2 plain_script.py         # no StepMeter: measured by wall clock

Strong scaling keeps the global problem of the smallest world size, weak keeps each rank's share
(:mod:`multigpu.bench.scaling`). A figure that was not measured is None in ``bench.json`` and "—" here.

Writes ``bench.json``, ``bench.png`` and one folder per run (``np<N>_r<k>``)
into ``--run-dir`` (default ``runs/bench/<timestamp>``); ``multigpu report``
turns that folder into an HTML page.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path
from typing import Any

from multigpu.units import shown

HELP = "run a workload at several world sizes: speedup, efficiency, communication share, imbalance"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.cli.launch import add_target_args
    from multigpu.cli.workload_line import add_config_flags
    from multigpu.jobs.registry import BUILTIN
    from multigpu.launch.flags import add_launch_flags

    parser = subparsers.add_parser("bench", help=HELP, description=HELP)
    add_own_flags(parser)
    parser.set_defaults(scaling="strong")
    add_config_flags(parser)
    add_launch_flags(parser)
    add_target_args(parser, metavar="script.py|workload",
                    help="a script (measured by its StepMeter, else by wall clock; what follows it is its own "
                         f"arguments), a built-in workload ({', '.join(BUILTIN)}) or pkg.module:WORKLOAD (what "
                         "follows it is read as `multigpu <workload>` reads it, with bench's flags, in any order)")
    return parser


def add_own_flags(parser: argparse.ArgumentParser) -> None:
    """bench's own flags (also taken after a workload's name)."""
    from multigpu.argtypes import positive_int
    from multigpu.cmdline import add_flag

    parser.add_argument("--nproc", default=None, metavar="N,M,...",
                        help="world sizes (processes per node) to run, e.g. 1,2,4; the first is the baseline (required)")
    scaling = parser.add_mutually_exclusive_group()
    scaling.add_argument("--strong", dest="scaling", action="store_const", const="strong",
                         help="keep the global problem fixed: each rank gets 1/N of it (default)")
    scaling.add_argument("--weak", dest="scaling", action="store_const", const="weak",
                         help="keep each rank's share fixed: the global problem grows with the world size")
    parser.add_argument("--repeat", type=positive_int, help="runs per world size (table: min and median; default 1)")
    add_flag(parser, "--run-dir", "-o", help="output folder (default runs/bench/<timestamp>)")
    add_predict_flags(parser)


def add_predict_flags(parser: argparse.ArgumentParser) -> None:
    from multigpu.bench.predict import LINKS, LOOPBACK

    group = parser.add_argument_group("prediction")
    group.add_argument("--predict", default=None, metavar="N,M,...",
                       help="also predict step time, speedup and efficiency at these world sizes (e.g. 8,64,512) "
                            "from the measured runs below the smallest of them and an alpha-beta model")
    group.add_argument("--interconnect", default=None, choices=[*LINKS, LOOPBACK],
                       help="the network of the prediction (default: loopback, this host measured, on CPU ranks; "
                            "nvlink4 on GPUs)")
    group.add_argument("--alpha-us", type=float, default=None, metavar="US",
                       help="latency per message in microseconds (overrides the interconnect's)")
    group.add_argument("--bandwidth-gbs", type=float, default=None, metavar="GB/S",
                       help="bandwidth per rank and direction in GB/s (overrides the interconnect's; e.g. from "
                            "`multigpu doctor`'s bus bandwidth)")
    group.add_argument("--ranks-per-node", type=int, default=None, metavar="R",
                       help="ranks on one node at the predicted sizes: an hsdp job's default shard group (default: "
                            "every rank with loopback, 8 on a GPU interconnect)")
    group.add_argument("--node-interconnect", default=None, choices=list(LINKS),
                       help="the link among the ranks of one node (e.g. nvlink4 under --interconnect ib-ndr): "
                            "collectives within a node (an hsdp replica's) run on it, those across nodes on "
                            "--interconnect (default: --interconnect for both)")


def check_predict(args: argparse.Namespace, nproc: tuple[int, ...]) -> bool:
    """The prediction's flags, checked before anything runs; whether there is a prediction to make."""
    from multigpu.bench.predict import LINKS, LOOPBACK, fit_sizes, parse_predict, resolve_link
    from multigpu.errors import ConfigError

    if args.predict is None:
        if (args.interconnect or args.alpha_us is not None or args.bandwidth_gbs is not None
                or args.ranks_per_node is not None or args.node_interconnect):
            raise ConfigError("--interconnect, --alpha-us, --bandwidth-gbs, --ranks-per-node and --node-interconnect "
                              "describe a prediction; valid: add --predict N,M (e.g. --predict 8,64)")
        return False
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        raise ConfigError(f"--ranks-per-node {args.ranks_per_node} is invalid; valid: a positive whole number")
    if args.node_interconnect and args.interconnect in (None, LOOPBACK):
        raise ConfigError(f"--node-interconnect {args.node_interconnect} needs a network between the nodes; valid: "
                          f"--interconnect one of {', '.join(LINKS)} beside it")
    for flag, value in (("--alpha-us", args.alpha_us), ("--bandwidth-gbs", args.bandwidth_gbs)):
        if value is not None and not (value > 0 and value != float("inf")):
            raise ConfigError(f"{flag} {value} is invalid; valid: a positive number")
    fit_sizes(nproc, parse_predict(args.predict))
    if args.interconnect not in (None, LOOPBACK):
        resolve_link(args.interconnect, alpha_us=args.alpha_us, bandwidth_gbs=args.bandwidth_gbs)
    return True


def add_prediction(args: argparse.Namespace, result: dict[str, Any], out: Path, launch_cfg) -> None:
    """Predict, print the table and its assumptions, add ``prediction`` to bench.json and draw it in bench.png."""
    from multigpu.bench.predict import (
        LINKS,
        LOOPBACK,
        LOOPBACK_NAME,
        Link,
        busy_cores,
        fit_sizes,
        parse_predict,
        predict,
        resolve_link,
    )
    from multigpu.bench.table import distrust
    from multigpu.errors import ConfigError
    from multigpu.monitor import write_json_atomic
    from multigpu.report.plots import save_bench_plot

    cpu_ranks = bool(launch_cfg.cpu or not result["host"]["gpus"])
    name = args.interconnect or (LOOPBACK if cpu_ranks else "nvlink4")
    measured, sweep = None, None
    if name == LOOPBACK and (args.alpha_us is None or args.bandwidth_gbs is None):
        from multigpu.doctor.pingpong import measure_link

        print("multigpu bench: measuring this host's loopback (ping-pong, 2 ranks) for the prediction",
              file=sys.stderr, flush=True)
        fig = measure_link()
        sweep = {str(k): v for k, v in fig["one_way_s"].items()}
        measured = Link(LOOPBACK_NAME, fig["alpha_s"], fig["bandwidth"], "measured by a ping-pong sweep, gloo")
    elif name == LOOPBACK:
        measured = Link(LOOPBACK_NAME, 0.0, 1.0, "flags")
    link = resolve_link(name, alpha_us=args.alpha_us, bandwidth_gbs=args.bandwidth_gbs, measured=measured)
    sizes, cores = parse_predict(args.predict), result["host"]["cores"]
    others = busy_cores(result["runs"], fit_sizes(result["nproc"], sizes), cores) if cpu_ranks else 0.0
    try:
        result["prediction"] = predict(result["runs"], sizes, link, scaling=result["scaling"], cores=cores,
                                       cpu_ranks=cpu_ranks, threads=launch_cfg.threads, other_work=others,
                                       ranks_per_node=args.ranks_per_node,
                                       node_link=LINKS[args.node_interconnect] if args.node_interconnect else None)
    except ConfigError as e:  # what only the runs could tell (an hsdp layout): the measured runs stay
        raise ConfigError(f"{e} (the measured runs are in {out / 'bench.json'})") from e
    if sweep:
        result["prediction"]["ping_pong_one_way_s"] = sweep  # by message bytes: where alpha and beta came from
    reasons = distrust(result["rows"], result["prediction"]["fit_on"], cpu_ranks=cpu_ranks)
    if reasons:  # kept in bench.json, marked; printed struck out; not drawn as if it were a prediction
        result["prediction"]["distrusted"] = reasons
    elif result.get("plot"):
        save_bench_plot(result, out)  # bench.png again, now with the predicted sizes and the assumptions' caption
    write_json_atomic(out / "bench.json", result)
    print_prediction(result["prediction"])


def print_prediction(pred: dict[str, Any], out=None) -> None:
    """The predicted rows, then the assumptions and what the prediction cannot know."""
    from rich.markup import escape
    from rich.table import Table

    from multigpu.bench.predict import row_label

    out = out or console()
    fit = ", ".join(map(str, pred["fit_on"]))
    distrusted = pred.get("distrusted") or []
    table = Table(title=f"predicted (fitted on {fit} rank(s); {pred['link']['name']})"
                        + (": NOT A PREDICTION, its runs are not trusted" if distrusted else ""))
    # "cores": waiting for this host's cores (ranks beyond them), shown where the model has it
    parts = ["compute", "imbalance", "latency", "bandwidth"] + (["cores"] if any(r.get("cores_s") for r in
                                                                                 pred["rows"]) else [])
    for name in ("ranks", "step (ms)", "speedup", "efficiency", *parts, "bottleneck", "measured (ms)", "error"):
        table.add_column(name, justify="right")
    for r in pred["rows"]:
        table.add_row(row_label(r), f"{r['step_time_s'] * 1e3:.2f}", f"{r['speedup']:.2f}x",
                      f"{r['efficiency']:.0%}", *(f"{r[k + '_s'] * 1e3:.2f}" for k in parts),
                      r["bottleneck"], shown(None if r["measured_step_time_s"] is None
                                             else r["measured_step_time_s"] * 1e3, ".2f"),
                      shown(r["error"], "+.0%"), style="strike dim" if distrusted else None)
    out.print(table)
    if distrusted:
        out.print(f"[bold yellow]not a prediction: the runs it is fitted on cannot be trusted "
                  f"({escape('; '.join(distrusted))}). Rerun with --repeat 3 (world sizes alternate) on a quieter "
                  "machine, then predict.[/bold yellow]", highlight=False)
    print_limits(out, pred, "the prediction")


def print_limits(out, result: dict[str, Any], what: str) -> None:
    """A model's ``assumptions`` and what ``what`` ``cannot_know``, a bulleted list each (bench's prediction,
    plan's answer)."""
    from rich.markup import escape

    for title, key in (("assumptions", "assumptions"), (f"{what} cannot know", "cannot_know")):
        out.print(f"{title}:", highlight=False)
        for line in result[key]:
            out.print(f"  - {escape(line)}", highlight=False)


def _out_dir(args: argparse.Namespace) -> Path:
    from multigpu.launch.rundir import refuse_used

    if args.run_dir is None:
        return Path("runs") / "bench" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    refuse_used(args.run_dir, hint="give a new folder")
    return Path(args.run_dir)


def console():
    """rich's Console; 120 columns when output is a file or pipe (rich would use 80), unless COLUMNS says."""
    import os

    from rich.console import Console

    return Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=120)


def print_table(result: dict[str, Any], out=None) -> None:
    """The scaling table and its verdicts, as rich renders them."""
    from rich.markup import escape
    from rich.table import Table

    from multigpu.units import fmt_rate

    out = out or console()
    unit = result.get("unit", "items")
    repeats = result.get("repeat", 1)
    table = Table(title=f"multigpu bench: {result.get('scaling', 'strong')} scaling"
                        f"{f', {repeats} repeats' if repeats > 1 else ''}")
    for name in ("ranks", f"{unit}/s (median)", f"{unit}/s (min)", "speedup", "ideal", "efficiency",
                 "step (ms)", "comm share", "imbalance"):
        table.add_column(name, justify="right")
    for r in result["rows"]:
        slower = r["speedup"] < 1 and r is not result["rows"][0]
        table.add_row(
            str(r["world_size"]), fmt_rate(r["throughput_median"]), fmt_rate(r["throughput_min"]),
            f"[red]{r['speedup']:.2f}x[/red]" if slower else f"{r['speedup']:.2f}x", f"{r['ideal']:.0f}x",
            f"{r['efficiency']:.0%}", f"{r['step_time_s'] * 1000:.1f}", shown(r["comm_share"], ".0%"),
            shown(r["imbalance"], ".2f"),
        )
    out.print(table)
    print_startup(result.get("startup") or [], out)
    for note in result.get("notes", []):
        style = "bold red" if note.startswith("SLOWER") else "bold yellow" if note.startswith(("NOISY", "STRAGGLER")) else None
        out.print(f"[{style}]{escape(note)}[/{style}]" if style else escape(note), highlight=False)


def print_startup(rows: list[dict[str, Any]], out=None) -> None:
    """Where start-up went per world size (``bench.json``'s ``startup``), in seconds; nothing without it."""
    from rich.table import Table

    from multigpu.monitor.startup import PARTS, TORCH_IMPORT

    if not rows:
        return
    out = out or console()
    names = [name for name, _, _ in PARTS if any(name in r["parts_s"] for r in rows)]
    table = Table(title="start-up: from the command to the first step (s, median)")
    for name in ("ranks", *names, "to first step", "first step", "torch import"):
        table.add_column(name, justify="right")
    for r in rows:
        table.add_row(str(r["world_size"]), *(shown(r["parts_s"].get(n), ".2f") for n in names),
                      shown(r["to_first_step_s"], ".2f"), shown(r["first_step_s"], ".2f"),
                      shown(r["torch_import_s"], ".2f"))
    out.print(table)
    out.print("start-up parts: " + "; ".join(f"{name}: {what}" for name, _, what in PARTS if name in names)
              + f". torch import: {TORCH_IMPORT}.", highlight=False)


def run(args: argparse.Namespace) -> int:
    from multigpu.bench import BenchConfig, parse_nproc, run_bench
    from multigpu.cli.workload_line import merge_workload_line, require_nproc, target_from_args
    from multigpu.errors import ConfigError
    from multigpu.launch.flags import config_from_args

    # everything that can be wrong with the input fails here, before any folder or process exists
    merge_workload_line(args, "bench", add_own_flags)
    if args.nproc_per_node != "auto":
        raise ConfigError("bench sets the world size itself: use --nproc 1,2,4 instead of --nproc-per-node")
    require_nproc(args, "bench", "1,2,4")
    bench = BenchConfig(nproc=parse_nproc(args.nproc), scaling=args.scaling or "strong", repeat=args.repeat or 1)
    launch_cfg = config_from_args(args)
    target = target_from_args(args, launch_cfg)
    predicting = check_predict(args, bench.nproc)
    out = _out_dir(args)

    def announce(n: int, k: int, run_dir: Path) -> None:
        again = f", repeat {k + 1}/{bench.repeat}" if bench.repeat > 1 else ""
        print(f"multigpu bench: {n} rank(s){again} -> {run_dir}", file=sys.stderr, flush=True)

    command = ["multigpu", "bench", *sys.argv[2:]] if sys.argv[1:2] == ["bench"] else []
    result = run_bench(bench, launch_cfg, target, out, command=command, on_run=announce)
    from multigpu.report.plots import save_bench_plot

    save_bench_plot(result, out)
    print_table(result)
    if predicting:
        add_prediction(args, result, out, launch_cfg)
    print(f"wrote {out / 'bench.json'}" + (f" and {out / result['plot']}" if result.get("plot") else ""))
    print(f"report: multigpu report {out}")
    return 0
