"""``multigpu plan``: how many GPUs of which type, how long and what it costs, before renting them (in the
launcher; nothing is launched).

    multigpu plan train arch=llama layers=32 hidden=4096 ffn=14336 heads=32 kv_heads=8 vocab=128256 seq=8192 \\
        batch=2 ac=selective strategy=fsdp --gpus H100-SXM,H200,B200 --count 8,16,32,64 --items 1e12 --deadline 14d
    multigpu plan train -f nano --gpus L4,A100-40GB --steps 5000        # a packaged preset or a YAML of train's
    multigpu plan runs/bench/20261129-0710 --steps 10000 --prices prices.yaml --sort cost   # a measured job
    multigpu plan runs/sim/20261129-0711 --items 1e11 --json              # sim, infer, rl, a script's run folder

A model description (``train`` with ``key=value`` sizes, or ``-f`` a train config) needs nothing to have run; a
folder written by ``multigpu bench`` or by any workload run (its ``summary.json``) plans from what was measured.
Prices come only from ``--prices FILE``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

HELP = "plan a job: GPU type x count, step time, time to the target, memory fit, cost and energy"
_COUNTS = "1,2,4,8,16,32,64"


def add_parser(subparsers) -> argparse.ArgumentParser:
    from multigpu.cmdline import add_flag

    parser = subparsers.add_parser("plan", help=HELP, description=HELP)
    parser.add_argument("source", nargs="?", metavar="train|FOLDER",
                        help="`train` (a model description: key=value sizes, or -f a train config) or a folder "
                             "written by `multigpu bench` or by a workload run (train, sim, infer, rl, a script)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="the model description (layers=, hidden=, seq=, batch=, ...: multigpu.plan.ModelSpec), "
                             "or with -f the train config's overrides")
    parser.add_argument("-f", "--config", metavar="FILE|PRESET", default=None,
                        help="a train config (a YAML path or a packaged preset such as nano) to plan from")
    parser.add_argument("--gpus", default=None, metavar="T1,T2",
                        help="GPU types from the catalog (default: all of them); see --list")
    parser.add_argument("--count", default=_COUNTS, metavar="N,M", help=f"GPU counts to plan (default {_COUNTS})")
    parser.add_argument("--network", default="ib-ndr", metavar="LINK",
                        help="the network between nodes (default ib-ndr; see --list)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--steps", type=float, default=None, help="the job's size in optimizer (or job) steps")
    size.add_argument("--items", "--tokens", dest="items", type=float, default=None,
                      help="the job's size in its unit: tokens (train), agent-steps (sim: agents x steps), windows "
                           "(infer), env-steps (rl)")
    parser.add_argument("--deadline", default=None, metavar="DURATION", help="e.g. 24h, 3d: the cheapest option that "
                        "meets it is picked; one that nothing meets is an error naming the fastest")
    parser.add_argument("--budget", type=float, default=None, help="the most to spend (the prices' currency)")
    parser.add_argument("--prices", default=None, metavar="FILE",
                        help="prices per GPU-hour (YAML; examples/plan/prices.example.yaml is an example)")
    parser.add_argument("--sort", choices=("cost", "time"), default=None,
                        help="order of the options (default: cost with --prices, else time)")
    parser.add_argument("--precision", default=None, metavar="P",
                        help="the target's matmul precision for a measured job (default: the run's, else fp32)")
    parser.add_argument("--measured-on", default=None, metavar="TYPE|cpu",
                        help="the device a measured folder ran on (default: bench.json's host)")
    parser.add_argument("--threads", type=int, default=None, metavar="T",
                        help="with --gpus cpu: threads per rank (default: the cores over the ranks)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="draw time vs cost (matplotlib)")
    add_flag(parser, "--out", "-o", default=None, metavar="DIR",
             help="write plan.json and plan.png into DIR (`multigpu report DIR` shows them)")
    parser.add_argument("--list", action="store_true", help="list the catalog's GPU types and links, and exit")
    return parser


def _csv(text: str, what: str, valid: str) -> list[str]:
    from multigpu.errors import ConfigError

    items = [p.strip() for p in text.split(",") if p.strip()]
    if not items:
        raise ConfigError(f"{what} {text!r} is empty; valid: {valid}")
    return items


def _counts(text: str) -> list[int]:
    from multigpu.errors import ConfigError

    try:
        counts = sorted({int(p) for p in _csv(text, "--count", "1,2,4,8")})
    except ValueError:
        raise ConfigError(f"--count {text!r} is invalid; valid: GPU counts such as 1,2,4,8") from None
    if counts[0] < 1:
        raise ConfigError(f"--count {text!r} is invalid; valid: whole numbers >= 1")
    return counts


def _value(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _job(args: argparse.Namespace, catalog):
    from multigpu.errors import ConfigError
    from multigpu.plan.measured import MeasuredJob
    from multigpu.plan.planner import DescribedJob
    from multigpu.plan.transformer import ModelSpec

    if args.source is None:
        raise ConfigError("plan needs what to plan: `train` with a model description (e.g. layers=12 hidden=768 "
                          "seq=1024 batch=12) or -f a train config, or a folder written by `multigpu bench` or a run")
    if args.source == "train":
        if args.config:
            from multigpu.plan.preset import spec_from_config

            return DescribedJob(spec_from_config(args.config, args.overrides))
        keys = {}
        for item in args.overrides:
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f"{item!r} is not key=value; valid: model sizes such as layers=12 hidden=768")
            keys[key.removeprefix("model.")] = _value(value)
        if "params" in keys and keys["params"] is not None:
            keys["params"] = float(keys["params"])
        return DescribedJob(ModelSpec.from_keys(keys))
    if args.source in ("sim", "infer", "rl", "envs") or args.source.endswith(".py"):
        raise ConfigError(f"plan {args.source}: a {'script' if args.source.endswith('.py') else 'workload'} is planned "
                          f"from what it measured; valid: run `multigpu bench --nproc 1,2 {args.source} ...` (or the "
                          "job itself), then `multigpu plan <its folder>`")
    if not Path(args.source).is_dir():
        raise ConfigError(f"plan {args.source!r}: no such folder; valid: `train` or a folder written by `multigpu "
                          "bench` or a workload run")
    if args.overrides:
        raise ConfigError(f"plan {args.source}: key=value ({args.overrides[0]}) describes a model; a measured folder "
                          "takes none")
    return _Measured(MeasuredJob.load(args.source, args.measured_on, catalog), args.precision)


class _Measured:
    """A measured job as the planner asks for it."""

    def __init__(self, job, precision: str | None):
        self.job = job
        self.unit = job.unit
        self.precision = precision or job.last.get("precision") or "fp32"
        if self.precision == "fp32" and job.last.get("tf32"):
            self.precision = "tf32"
        self._errors: list[float] = []

    def step(self, cluster, catalog, precision, threads=None):
        step = self.job.step(cluster, catalog, precision, threads)
        self._errors = step["fit_errors"]
        return step

    def interval(self):
        from multigpu.plan.planner import interval_factor

        sizes = sorted({r["world_size"] for r in self.job.runs})
        errors = _fit_residuals(self.job)
        factor, how = interval_factor(errors)
        return factor, how + f" (the fit's residuals at the measured sizes {', '.join(map(str, sizes))})"

    def assumptions(self):
        from multigpu.plan.model import BANDWIDTH_EFFICIENCY, MATMUL_EFFICIENCY

        j = self.job
        sizes = ", ".join(str(r["world_size"]) for r in j.runs)
        return [
            f"measured: {j.path} ({j.unit}, world sizes {sizes}) on {j.device}",
            "compute per step: bench --predict's fit of the measured runs at the target's size, carried to the target "
            f"GPU by a roofline: the FLOP-bound share at {MATMUL_EFFICIENCY:.1%} of its dense peak, the rest at "
            f"{BANDWIDTH_EFFICIENCY:.0%} of its memory bandwidth, against the measured device's "
            + ("rates measured on this host's CPU (a float32 matmul and a copy, at the ranks' thread count)"
               if j.device == "cpu" else "catalog figures at the same efficiencies"),
            ("communication: the collectives the step meter counted, priced on the target's links by bench --predict's "
             f"alpha-beta model, hidden behind compute as {j.strategy or 'the workload'} overlaps it"
             if any(r["world_size"] > 1 for r in j.runs) else
             "communication: none measured (a 1-rank run): the plan counts compute alone; bench at 2 ranks or more "
             "to count the job's collectives"),
            "memory per GPU: " + ("the measured peak per rank (on CPU ranks: the resident memory less what "
                                  "`import torch` holds); under FSDP its training state moves to 1/N"
                                  if j.last.get("peak_memory_bytes") else "not measured by this workload"),
        ]


def _fit_residuals(job) -> list[float]:
    """Log errors of bench --predict's fit at each measured size (leave-nothing-out: what the fit does not
    explain of its own points)."""
    from multigpu.bench.predict import LINKS, predict

    sizes = sorted({r["world_size"] for r in job.runs})
    if len(job.runs) < 2:
        return []
    pred = predict(job.runs, sizes, LINKS["nvlink4"], fit_on=sizes)
    return [math.log(1 + r["error"]) for r in pred["rows"] if r.get("error") is not None and r["error"] > -1]


def _hours(seconds: float) -> str:
    from multigpu.plan.planner import format_duration

    return format_duration(seconds) if math.isfinite(seconds) else "never"


def _gib(b: float | None) -> str:
    return "—" if b is None else f"{b / 2**30:.1f}"


def print_plan(result: dict[str, Any], out=None) -> None:
    from rich.table import Table

    from multigpu.cli.bench import console, print_limits

    out = out or console()
    unit = result["unit"]
    cur = (result["prices"] or {}).get("currency") or ""
    table = Table(title=f"multigpu plan: {result['size']['text']}, sorted by {result['sort']}")
    for name in ("GPUs", "nodes", "step", f"{unit}/s", "time (95% interval)", "memory per GPU (GiB)", "GPU-hours",
                 f"cost {cur}".strip(), "kWh", "bound by"):
        table.add_column(name, justify="right")
    best = result["best"]
    for o in result["options"]:
        if o["fits"] is False:
            memory = f"[red]does not fit: needs {_gib(o['need_bytes'])} of {_gib(o['have_bytes'])}[/red]"
        elif o["fits"] is None:
            memory = "not measured"
        else:
            memory = f"{_gib(o['need_bytes'])} of {_gib(o['have_bytes'])}"
        star = best is not None and (o["gpu"], o["count"]) == (best["gpu"], best["count"])
        step = (f"{o['step_s'] * 1e6:.0f} us" if o["step_s"] < 1e-3 else f"{o['step_s'] * 1e3:.1f} ms"
                if o["step_s"] < 10 else f"{o['step_s']:.1f} s")
        table.add_row(f"{'* ' if star else ''}{o['count']} x {o['gpu']}", str(o["nodes"]), step,
                      f"{o['items_per_s']:,.0f}",
                      f"{_hours(o['time_s'])} ({_hours(o['time_low_s'])}-{_hours(o['time_high_s'])})", memory,
                      f"{o['gpu_hours']:,.0f}", "—" if o["cost"] is None else f"{o['cost']:,.0f}",
                      "—" if o["kwh"] is None else f"{o['kwh']:,.0f}", o["bottleneck"], style="bold" if star else ("dim" if o["fits"] is False else None))
    out.print(table)
    if best is not None:
        what = f"cost {best['cost']:,.0f} {cur}".strip() if best["cost"] is not None else \
            f"{best['gpu_hours']:,.0f} GPU-hours (no prices: fewest GPU-hours)"
        goal = " that meets the deadline" if result["deadline_s"] else ""
        out.print(f"best{goal}: {best['count']} x {best['gpu']}: {_hours(best['time_s'])}, {what}", highlight=False)
    else:
        out.print("best: none (no option fits in memory)", highlight=False)
    print_limits(out, result, "the plan")


def _list(catalog) -> None:
    for g in catalog.gpus.values():
        peaks = ", ".join(f"{p} {v:g}" for p, v in g.tflops.items())
        print(f"{g.key:10s} {g.memory_gb:g} GB, {g.hbm_tbs:g} TB/s, {g.tdp_w:g} W, {g.node_link}; TFLOP/s dense: {peaks}"
              f"  [{g.sources[0]['url']}]")
    for link in catalog.links.values():
        print(f"{link.key:12s} {link.name}: {link.gbs:g} GB/s per GPU and direction  [{link.source.get('url', '')}]")


def run(args: argparse.Namespace) -> int:
    from multigpu.errors import ConfigError
    from multigpu.plan.catalog import load_catalog, load_prices
    from multigpu.plan.planner import Size, make_plan, parse_duration

    catalog = load_catalog()
    if args.list:
        _list(catalog)
        return 0
    # everything that can be wrong with the input fails here, before anything is written
    gpus = [catalog.gpu(name) for name in _csv(args.gpus, "--gpus", ", ".join(catalog.gpus))] if args.gpus \
        else list(catalog.gpus.values())
    counts = _counts(args.count)
    network = catalog.link(args.network)
    deadline = parse_duration(args.deadline) if args.deadline else None
    if args.budget is not None and not args.budget > 0:
        raise ConfigError(f"--budget {args.budget} is invalid; valid: a positive amount")
    for flag, value in (("--steps", args.steps), ("--items", args.items)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{flag} {value} is invalid; valid: a positive number")
    if args.steps is None and args.items is None:
        raise ConfigError("plan needs the job's size: --steps N or --items N (tokens, agent-steps, windows, "
                          "env-steps: the run's unit)")
    prices = load_prices(args.prices, catalog) if args.prices else None
    if args.plot and not args.plot.endswith(".png"):
        raise ConfigError(f"--plot {args.plot}: valid: a .png file name")
    job = _job(args, catalog)
    result = make_plan(job, gpus=gpus, counts=counts, network=network,
                       size=Size(steps=args.steps, items=args.items), catalog=catalog, prices=prices,
                       deadline_s=deadline, budget=args.budget, sort=args.sort, precision=args.precision,
                       threads=args.threads)
    result["command"] = ["multigpu", "plan", *getattr(args, "_argv", [])]
    figure = None
    if args.plot or args.out:
        try:
            from multigpu.report.plots import plan_figure

            figure = plan_figure(result)
        except ImportError as exc:
            if args.plot:
                raise ConfigError(f"--plot: {exc}") from None
    if args.out:
        from multigpu.files import write_text_atomic
        from multigpu.report.plots import save_png

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(out / "plan.json", json.dumps(result, indent=2, default=str))
        if figure is not None:
            save_png(figure, out / "plan.png")
    if args.plot and figure is not None:
        from multigpu.report.plots import save_png

        save_png(figure, args.plot)
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=str)
        print()
    else:
        print_plan(result)
        for path in ([args.plot] if args.plot else []) + ([str(Path(args.out) / "plan.json")] if args.out else []):
            print(f"wrote {path}")
    return 0
