"""Options for a job: GPU type x count, each with its step time, throughput, time to the target, memory fit, cost
and energy; the cheapest that meets a deadline; what the plan assumes (pure but for the measured device's rates;
in the launcher).

    result = make_plan(job, gpus=[...], counts=[8, 16], network=catalog.link("ib-ndr"), size=Size(steps=1000))
    result["options"], result["best"], result["assumptions"]

``job`` is a :class:`DescribedJob` (a model description) or a :class:`multigpu.plan.measured.MeasuredJob`.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass
from typing import Any

from multigpu.errors import ConfigError

__all__ = ["DescribedJob", "Size", "format_duration", "interval_factor", "make_plan", "parse_duration", "pareto"]

_GIB = 2**30
_T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23}
"""Student's t, two-sided 95%, by degrees of freedom (a prediction interval from n residuals: n - 1 of them)."""


def parse_duration(text: str) -> float:
    """``"24h"``, ``"90m"``, ``"3d"``, ``"1.5h"``, ``"3600s"`` -> seconds; one line naming what is valid."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--deadline {text!r} is invalid; valid: a duration such as 90m, 24h, 3d")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def interval_factor(log_errors: list[float]) -> tuple[float, str]:
    """``(factor, how)``: a 95% prediction interval is ``point / factor .. point * factor``, from the residuals'
    log errors (t x their root mean square x sqrt(1 + 1/n)); 1.0 with fewer than two residuals."""
    n = len(log_errors)
    if n < 2:
        return 1.0, "no interval: fewer than two residuals to take it from"
    rms = math.sqrt(statistics.fmean(e * e for e in log_errors))
    t = _T95.get(n - 1, 1.96)
    factor = math.exp(t * rms * math.sqrt(1 + 1 / n))
    return factor, f"95% prediction interval x/ {factor:.2f} (t = {t:.2f} x the RMS log error {rms:.3f} of {n} residuals)"


@dataclass(frozen=True)
class Size:
    """The job's size: optimizer steps, or items in the run's unit (tokens, agent-steps, windows, env-steps)."""

    steps: float | None = None
    items: float | None = None

    def seconds(self, step: dict[str, Any]) -> float:
        if self.steps is not None:
            return self.steps * step["step_s"]
        return self.items / step["items_per_s"] if step["items_per_s"] > 0 else math.inf

    def describe(self, unit: str) -> str:
        return f"{self.steps:,.0f} steps" if self.steps is not None else f"{self.items:,.0f} {unit}"


class DescribedJob:
    """A training job from its model description (:class:`multigpu.plan.transformer.ModelSpec`)."""

    unit = "tokens"

    def __init__(self, spec):
        self.spec = spec

    def step(self, cluster, catalog, precision: str | None = None) -> dict[str, Any]:
        from multigpu.plan.model import describe_step

        return describe_step(self.spec, cluster, catalog)

    @property
    def precision(self) -> str:
        return self.spec.precision

    def interval(self) -> tuple[float, str]:
        from multigpu.plan.cases import validate

        errs = [math.log(1 + r["error"]) for r in validate() if r["error"] is not None and r["target"]]
        factor, how = interval_factor(errs)
        return factor, how + " (the published cases of multigpu.plan.cases)"

    def assumptions(self) -> list[str]:
        from multigpu.plan.model import BANDWIDTH_EFFICIENCY, MATMUL_EFFICIENCY, OVERLAP

        s = self.spec
        return [
            f"the job: {s.name}, {s.total_params / 1e9:.3g}B parameters ({s.layers} layers, hidden {s.hidden}, "
            f"sequence {s.seq}), {s.batch} x {s.seq} tokens per micro-step per GPU, grad_accum {s.grad_accum}, "
            f"{s.precision} matmuls, activation checkpointing {s.ac}, compile {'on' if s.compile else 'off'}, "
            f"{s.attention} attention, strategy {s.strategy}",
            f"compute: FLOPs per token {sum(s.flops_per_token().values()) / 1e9:.3g} G (matmuls incl. recompute and "
            f"causal attention) at {MATMUL_EFFICIENCY:.1%} of the GPU's dense peak (the one fitted constant: "
            "multigpu.plan.model.MATMUL_EFFICIENCY), plus the memory-bound kernels' bytes at "
            f"{BANDWIDTH_EFFICIENCY:.0%} of its memory bandwidth (a roofline; the two add)",
            f"communication: FSDP/DDP's collectives priced by bench --predict's alpha-beta model; inside a node on "
            f"the GPU's own link, across nodes on the network; hidden behind {OVERLAP[s.strategy]:.0%} of the "
            "compute (overlap)",
            "memory per GPU: fp32 parameters, gradients and AdamW (16 bytes per parameter, sharded under fsdp/hsdp), "
            "two gathered FSDP units, the activations kept for backward and the fp32 logits; the CUDA context and "
            "the allocator's fragmentation are not counted",
        ]


def pareto(options: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The options no other beats on both time and ``key`` (cost or GPU-hours), fastest first."""
    ok = sorted((o for o in options if o["fits"] is not False and o[key] is not None), key=lambda o: o["time_s"])
    front, best = [], math.inf
    for o in ok:
        if o[key] < best:
            front.append(o)
            best = o[key]
    return front


def _gpu_ok(gpu, precision: str) -> bool:
    return precision in gpu.tflops


def make_plan(job, *, gpus: list, counts: list[int], network, size: Size, catalog, prices=None,
              deadline_s: float | None = None, budget: float | None = None, sort: str | None = None,
              precision: str | None = None, threads: int | None = None) -> dict[str, Any]:
    from multigpu.plan.model import Cluster

    precision = precision or job.precision
    usable = [g for g in gpus if _gpu_ok(g, precision)]
    skipped = [f"{g.key}: no sourced {precision} peak in the catalog{f' ({g.missing})' if g.missing else ''}"
               for g in gpus if not _gpu_ok(g, precision)]
    if not usable:
        raise ConfigError(f"no GPU type given has a {precision} peak in the catalog ({'; '.join(skipped)}); valid: "
                          f"--gpus among {', '.join(g.key for g in catalog.gpus.values() if _gpu_ok(g, precision))}")
    if budget is not None and prices is None:
        raise ConfigError("--budget needs prices: --prices FILE (e.g. examples/plan/prices.example.yaml, an example)")
    factor, interval_how = job.interval()
    options = []
    for gpu in usable:
        for count in counts:
            if gpu.key == "cpu":
                if not hasattr(job, "job"):
                    raise ConfigError("--gpus cpu plans a folder measured on this host's CPU ranks; a model description "
                                      "has no CPU model; valid: GPU types of the catalog")
                step = job.job.step(Cluster(gpu, count, network), catalog, precision, threads)
            else:
                step = job.step(Cluster(gpu, count, network), catalog, precision)
            t = size.seconds(step)
            low_s = step.get("step_low_s", step["step_s"]) / factor
            high_s = step.get("step_high_s", step["step_s"]) * factor
            hours = t / 3600
            price = prices.hourly(gpu.key) if prices else None
            kwh = count * gpu.tdp_w * hours / 1000 if gpu.tdp_w else None
            cost = None
            if price is not None:
                cost = count * price * hours + (kwh * prices.per_kwh if prices.per_kwh else 0.0)
            need = step["memory"]["total"] if step["memory"] else None
            options.append({
                "gpu": gpu.key, "count": count, "nodes": math.ceil(count / gpu.per_node), "step_s": step["step_s"],
                "step_low_s": low_s, "step_high_s": high_s, "items_per_s": step["items_per_s"], "time_s": t,
                "time_low_s": t * low_s / step["step_s"] if step["step_s"] else t,
                "time_high_s": t * high_s / step["step_s"] if step["step_s"] else t,
                "fits": step["fits"], "need_bytes": need, "have_bytes": step["memory_have"], "threads": threads,
                "gpu_hours": count * hours, "kwh": kwh, "cost": cost, "bottleneck": step["bottleneck"],
                "compute_s": step["compute_s"], "comm_s": step["comm_s"], "exposed_comm_s": step["exposed_comm_s"],
                "meets_deadline": None if deadline_s is None else t <= deadline_s,
                "within_budget": None if budget is None or cost is None else cost <= budget,
                **({"roofline": step["roofline"]} if "roofline" in step else {}),
            })
    sort = sort or ("cost" if prices else "time")
    if sort == "cost" and prices is None:
        raise ConfigError("--sort cost needs prices: --prices FILE (e.g. examples/plan/prices.example.yaml, an example)")

    def order(o):
        unfit = o["fits"] is False
        primary = (o["cost"] if o["cost"] is not None else math.inf) if sort == "cost" else o["time_s"]
        return (unfit, primary, o["time_s"])

    options.sort(key=order)
    ok = [o for o in options if o["fits"] is not False]
    best = _best(ok, deadline_s, budget, prices)
    assumptions = job.assumptions() + [
        f"network across nodes: {network.name} ({network.gbs:g} GB/s per GPU and direction, latency "
        f"{network.alpha_us:g} us: a nominal figure, not a datasheet's); {usable[0].per_node} GPUs per node",
        interval_how,
        "energy: every GPU at its board's TDP for the whole run (an upper bound for the GPUs; hosts, network and "
        "cooling not counted)",
        "cost: " + (f"GPU-hours x the prices of {prices.path} ({prices.currency}"
                    + (f", dated {prices.date}" if prices.date else "")
                    + (", AN EXAMPLE FILE, not a quote" if prices.example else "") + ")" if prices else
                    "not computed (no --prices FILE)"),
    ] + skipped
    return {"unit": job.unit, "size": {"steps": size.steps, "items": size.items, "text": size.describe(job.unit)},
            "deadline_s": deadline_s, "budget": budget, "sort": sort, "precision": precision,
            "options": options, "best": best, "pareto": [(o["gpu"], o["count"]) for o in
                                                          pareto(options, "cost" if prices else "gpu_hours")],
            "assumptions": assumptions, "cannot_know": CANNOT_KNOW,
            "prices": None if prices is None else {"path": prices.path, "currency": prices.currency,
                                                   "date": prices.date, "example": prices.example},
            "sources": {g.key: list(g.sources) for g in usable}}


def _best(ok: list[dict[str, Any]], deadline_s, budget, prices) -> dict[str, Any] | None:
    """The cheapest option that fits and meets the deadline and budget; ConfigError naming the fastest (or the
    cheapest) when none does."""
    if not ok:
        return None
    pool = ok
    if deadline_s is not None:
        pool = [o for o in pool if o["time_s"] <= deadline_s]
        if not pool:
            fast = min(ok, key=lambda o: o["time_s"])
            raise ConfigError(f"no option meets --deadline {format_duration(deadline_s)}: the fastest that fits is "
                              f"{fast['count']} x {fast['gpu']} at {format_duration(fast['time_s'])}; valid: a later deadline, "
                              "more GPUs (--count) or other types (--gpus)")
    if budget is not None:
        within = [o for o in pool if o["cost"] is not None and o["cost"] <= budget]
        if not within:
            priced = [o for o in pool if o["cost"] is not None]
            if not priced:
                raise ConfigError("--budget: no option has a price (the prices file names none of the GPU types "
                                  "planned); valid: prices for them in --prices FILE")
            cheap = min(priced, key=lambda o: o["cost"])
            raise ConfigError(f"no option fits --budget {budget:g}: the cheapest is {cheap['count']} x {cheap['gpu']} "
                              f"at {cheap['cost']:,.0f} ({format_duration(cheap['time_s'])}); valid: a larger budget or a "
                              "later deadline")
        pool = within
    key = "cost" if prices and any(o["cost"] is not None for o in pool) else "gpu_hours"
    return min((o for o in pool if o[key] is not None), key=lambda o: (o[key], o["time_s"]), default=None)


def format_duration(seconds: float) -> str:
    """``seconds`` as people say it: ``42.0 min``, ``5.5 h``, ``4.0 days`` (the reverse of :func:`parse_duration`)."""
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


CANNOT_KNOW = [
    "kernel launch and Python overhead: a small model on a fast GPU can be bound by them, not by FLOPs or bytes",
    "the network's real topology and congestion (one port per GPU at full bisection is assumed), and stragglers",
    "the data pipeline: loading is assumed to keep up (it is not in a description; a measured run includes it)",
    "the software stack's own speed (a new kernel, a compiler version): the validation table shows how far off "
    "the model was on published runs",
    "memory the allocator wastes to fragmentation and the CUDA context (hundreds of MiB per GPU)",
]
