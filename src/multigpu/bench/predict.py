"""``multigpu bench --predict 8,64,512``: step time, speedup and efficiency at world sizes not run (in the launcher).

    pred = predict(runs, sizes=(8, 64), link=LINKS["ib-ndr"], scaling="strong", cores=16, cpu_ranks=False)

From the bench's own runs (one ``summary.json`` each, written by ``StepMeter``):

* *compute* per step: the measured step time minus the modelled communication, fitted as
  ``a + b x`` with ``x`` the items one rank handles per step (``a``: the part no split shares); items
  per step follow ``N ** g`` as measured (g = 0: a fixed global problem, 1: a fixed share per rank);
  the slowest rank's busy time over the mean (imbalance) is kept as measured;
* *traffic* per step: the calls and bytes of every collective the job made
  (``collectives.record_traffic``: DDP's gradient buckets, the simulation's halo and migration,
  inference's window exchange; FSDP's all-gathers and reduce-scatters from its sharding), as measured
  at the largest world size fitted on; HSDP's run over the groups of its mesh (all-gathers and reduce-scatters
  within a replica, the gradient shards' all-reduce across replicas: ``_shards`` says how large at each N);
* *the interconnect*: an alpha-beta model, ``latency + bytes / bandwidth`` per message, with the
  textbook ring/tree costs of each collective (:func:`cost`), from :data:`LINKS` or measured figures.

On ``loopback`` (this host, CPU ranks) the ranks also share its cores: compute slows by
``(N x threads x held + other work) / cores`` beyond them, where *held* is the share of a rank's step
outside collectives and *other work* the cores the device sampler saw busy beside the ranks.

Where each rank's CPU seconds per step were measured (``StepMeter``), the cores also bound the step from below:
N ranks need N x the CPU one rank used per step (computing, scaled as the fit, plus the collectives' own CPU at
the largest size fitted on, grown with the messages a rank waits for) from the cores free of other work; the
excess over the step below is the ``cores`` part.

Predicted step = slowest rank's compute + communication (no overlap), or that bound. The fit uses
the measured world sizes below the smallest one predicted: a size that was also
measured shows both, and the error.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from multigpu.errors import ConfigError

__all__ = ["LINKS", "Link", "Net", "busy_cores", "comm_time", "cost", "fit_sizes", "parse_predict", "predict",
           "resolve_link", "row_label"]


@dataclass(frozen=True)
class Link:
    """An interconnect as the alpha-beta model sees it."""

    name: str
    alpha_s: float
    """Latency of one message (seconds)."""
    bandwidth: float
    """Bytes per second one rank can send (and receive at once) to another."""
    source: str = "nominal"
    """Where the figures came from: nominal (the table), measured, or flags."""


LINKS: dict[str, Link] = {
    "nvlink4": Link("NVLink 4 (H100 SXM, GPUs of one node)", 3e-6, 450e9),
    "pcie5": Link("PCIe 5 x16 (GPUs of one node, no NVLink)", 5e-6, 64e9),
    "ib-ndr": Link("InfiniBand NDR 400 Gb/s, one port per GPU", 5e-6, 50e9),
    "eth400": Link("400 GbE with RoCE, one port per GPU", 10e-6, 50e9),
    "eth100": Link("100 GbE over TCP, one port per node's rank", 30e-6, 12.5e9),
}
"""Nominal per-direction figures; real collectives reach 70-90% of these bandwidths (NCCL's busbw)."""
LOOPBACK = "loopback"
"""This host's gloo over loopback, measured by a ping-pong sweep after the bench runs (ranks share its cores)."""


def parse_predict(text: str) -> tuple[int, ...]:
    """``"8,64,512"`` -> ``(8, 64, 512)``: distinct whole numbers >= 2, ascending."""
    try:
        sizes = sorted({int(p.strip()) for p in text.split(",") if p.strip()})
    except ValueError:
        raise ConfigError(f"--predict {text!r} is invalid; valid: world sizes such as 8,64,512") from None
    if not sizes or sizes[0] < 2:
        raise ConfigError(f"--predict {text!r} is invalid; valid: world sizes >= 2 such as 8,64,512")
    return tuple(sizes)


def fit_sizes(measured: Sequence[int], predicted: Sequence[int]) -> tuple[int, ...]:
    """The measured world sizes the model is fitted on: those below the smallest predicted one.

    Raises ConfigError (before anything runs) when there is none."""
    below = tuple(n for n in sorted(measured) if n < min(predicted))
    if not below:
        raise ConfigError(f"--predict {','.join(map(str, predicted))} needs a measured world size below "
                          f"{min(predicted)} to fit on; valid: --nproc 1,2 --predict 4,8 (or larger --predict sizes)")
    return below


def resolve_link(name: str | None, *, alpha_us: float | None = None, bandwidth_gbs: float | None = None,
                 measured: Link | None = None) -> Link:
    """The interconnect: a table entry or ``loopback`` (``measured``), then the flags' figures over it."""
    if name == LOOPBACK:
        if measured is None:
            raise ConfigError("--interconnect loopback needs its measured figures; valid: --alpha-us and "
                              "--bandwidth-gbs, or let bench measure them")
        link = measured
    elif name in LINKS:
        link = LINKS[name]
    else:
        raise ConfigError(f"--interconnect {name!r} is unknown; valid: {', '.join([*LINKS, LOOPBACK])}")
    if alpha_us is not None or bandwidth_gbs is not None:
        link = replace(link, alpha_s=link.alpha_s if alpha_us is None else alpha_us * 1e-6,
                       bandwidth=link.bandwidth if bandwidth_gbs is None else bandwidth_gbs * 1e9, source="flags")
    return link


def busy_cores(runs: Sequence[dict[str, Any]], sizes: Sequence[int], cores: int) -> float:
    """Cores this host spent on other work during the runs at ``sizes`` (mean), from the device sampler's
    host and rank CPU figures (bench's ``cpu``); 0 when none was sampled."""
    seen = [max(0.0, r["cpu"]["host_percent"] / 100 * cores - r["cpu"]["rank_percent"] / 100 * int(r["world_size"]))
            for r in runs if int(r["world_size"]) in sizes and r.get("cpu")]
    return statistics.fmean(seen) if seen else 0.0


# ----------------------------------------------------------------------------- the alpha-beta model
def _log2(n: int) -> int:
    return math.ceil(math.log2(n))


def cost(kind: str, n: int, nbytes: float, link: Link) -> tuple[float, float]:
    """``(latency seconds, bandwidth seconds)`` of one collective of ``kind`` at ``n`` ranks, into which each
    rank puts ``nbytes`` (as ``collectives.record_traffic`` counts them).

    all_reduce: ring ``2(n-1) a + 2(n-1)/n S b`` or tree ``2 log2(n) (a + S b)``, whichever is faster;
    all_gather: ring ``(n-1)(a + s b)`` or recursive doubling ``log2(n) a + (n-1) s b``;
    sharded_all_gather (S = the whole result): ``(n-1) a`` or ``log2(n) a``, plus ``(n-1)/n S b``;
    gather: binomial tree ``log2(n) a + (n-1) s b``; broadcast: tree ``log2(n) (a + S b)``;
    reduce_scatter: ring ``(n-1)(a + S/n b)``; all_to_all: pairwise ``(n-1) a + (n-1)/n S b``;
    p2p: ``a + s b``. ``a`` = latency, ``b`` = 1 / bandwidth.
    """
    if n < 2:
        return 0.0, 0.0
    a, b, s, lg = link.alpha_s, 1.0 / link.bandwidth, float(nbytes), _log2(n)
    if kind == "all_reduce":
        options = [(2 * (n - 1) * a, 2 * (n - 1) / n * s * b), (2 * lg * a, 2 * lg * s * b)]
    elif kind == "all_gather":
        options = [((n - 1) * a, (n - 1) * s * b), (lg * a, (n - 1) * s * b)]
    elif kind == "sharded_all_gather":  # S: the whole gathered tensor (FSDP's parameters), 1/n from each rank
        options = [((n - 1) * a, (n - 1) / n * s * b), (lg * a, (n - 1) / n * s * b)]
    elif kind == "gather":
        options = [(lg * a, (n - 1) * s * b)]
    elif kind == "broadcast":
        options = [(lg * a, lg * s * b)]
    elif kind in ("reduce_scatter", "all_to_all"):  # S: a rank's whole input, of which it keeps 1/n
        options = [((n - 1) * a, (n - 1) / n * s * b)]
    elif kind == "p2p":
        options = [(a, s * b)]
    else:
        raise ValueError(f"no cost formula for collective kind {kind!r}")
    return min(options, key=sum)


# ----------------------------------------------------------------------------- what was measured
@dataclass(frozen=True)
class _Point:
    """One measured world size (median over repeats)."""

    n: int
    step_s: float
    compute_mean_s: float | None
    """Mean over ranks of busy (non-communication) seconds per step; None when comm was not measured."""
    compute_max_s: float | None
    """The slowest rank's busy seconds per step (their ratio to the mean is the load imbalance)."""
    items_per_step: float
    traffic: dict[str, dict[str, float]]
    cpu_mean_s: float | None = None
    """Mean over ranks of the CPU seconds a rank's process spent per step (all its threads); None: not measured."""
    shard_size: int | None = None
    """HSDP: the ranks of one replica in this run; None: not HSDP."""
    shard_set: bool = False
    """HSDP: whether the shard size was chosen (``hsdp_shard_size``) rather than the ranks per node."""


def _mean_step(summary: dict[str, Any]) -> float:
    """The job's step time as its throughput sees it: the slowest rank's wall time over the measured steps.

    Not the median of each step's slowest rank: where ranks share cores, which rank is late changes from step to
    step, and the per-step maximum then sits above the pace the job keeps (10-20% at 3 and 4 ranks on 2 cores)."""
    if summary.get("wall_s") and summary.get("steps"):
        return summary["wall_s"] / summary["steps"]
    return summary["step_time_s"]["median"]


def _point(n: int, summaries: list[dict[str, Any]]) -> _Point:
    means, maxes, cpus = [], [], []
    for s in summaries:
        cpu = [r["cpu_s"] / r["steps"] for r in s.get("per_rank", []) if r.get("cpu_s") is not None and r["steps"]]
        if cpu and len(cpu) == len(s.get("per_rank", [])):
            cpus.append(statistics.fmean(cpu))
        per = [r["busy_s"] / r["steps"] for r in s.get("per_rank", []) if r.get("busy_s") is not None and r["steps"]]
        if per and len(per) == len(s.get("per_rank", [])):
            means.append(statistics.fmean(per))
            maxes.append(max(per))
    traffic = summaries[len(summaries) // 2].get("traffic") or {}
    hsdp = summaries[0].get("hsdp") or {}
    return _Point(
        n=n,
        step_s=statistics.median(_mean_step(s) for s in summaries),
        compute_mean_s=statistics.median(means) if len(means) == len(summaries) else None,
        compute_max_s=statistics.median(maxes) if len(maxes) == len(summaries) else None,
        items_per_step=statistics.median(s["items"] / max(s["steps"], 1) for s in summaries),
        traffic=traffic,
        cpu_mean_s=statistics.median(cpus) if len(cpus) == len(summaries) else None,
        shard_size=hsdp.get("shard_size"),
        shard_set=bool(hsdp.get("set")),
    )


Shards = Callable[[int], int]
"""HSDP: the ranks of one replica at world size N."""


@dataclass(frozen=True)
class Net:
    """Where each collective runs (also ``multigpu plan``'s network of a target cluster): ``link`` between nodes; ``node_link`` (when given) among the ranks of one
    node, i.e. a collective whose ranks all fit in one node of ``per_node`` consecutive ranks; ``shards``: an HSDP
    job's shard group at N."""

    link: Link
    node_link: Link | None = None
    per_node: int | None = None
    shards: Shards | None = None

    def over(self, span: int) -> Link:
        """The link of a collective among ``span`` consecutive ranks."""
        if self.node_link is not None and self.per_node and span <= self.per_node:
            return self.node_link
        return self.link


def comm_time(traffic: dict[str, dict[str, float]], n: int, net: Net, messages: bool = False) -> tuple[float, float]:
    """``(latency, bandwidth)`` seconds of one step's collectives at N (``traffic`` as ``StepMeter`` writes it:
    ``{kind[:group]: {"calls": per step, "bytes": per step}}``; ``multigpu plan`` prices its own the same way); ``messages``: the latency term counted in
    messages instead (each collective's latency over its link's, the faster of ring and tree chosen as in time)."""
    latency = bandwidth = 0.0
    for key, fig in traffic.items():
        if not fig["calls"]:
            continue
        kind, _, over = key.partition(":")  # HSDP's collectives run over a group of its mesh (record_traffic)
        ranks, nbytes, span = n, fig["bytes"] / fig["calls"], n
        if over:
            k = net.shards(n) if net.shards else n
            # a replica's ranks are consecutive (one node by default); the replicas of a shard are spread over all
            ranks, nbytes, span = (k, nbytes, k) if over == "shard" else (n // k, nbytes / k, n)
        link = net.over(span)
        if messages and link.alpha_s <= 0:
            link = replace(link, alpha_s=1.0)
        lat, bw = cost(kind, ranks, nbytes, link)
        if messages:
            lat /= link.alpha_s
        latency += fig["calls"] * lat
        bandwidth += fig["calls"] * bw
    return latency, bandwidth


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` with a, b >= 0; one point: ``a = 0``."""
    if len(xs) == 1 or len(set(xs)) == 1:
        return 0.0, statistics.fmean(y / x for x, y in zip(xs, ys, strict=True))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    if b < 0:  # more ranks made each rank slower: nothing shrinks with N; keep the mean
        return my, 0.0
    if a < 0:
        return 0.0, statistics.fmean(y / x for x, y in zip(xs, ys, strict=True))
    return a, b


def _hops(traffic: dict[str, dict[str, float]], n: int, net: Net) -> float:
    """Messages one rank waits for per step at N (the latency term counted in messages)."""
    return comm_time(traffic, n, net, messages=True)[0]


UNTIMED_KINDS = ("sharded_all_gather", "reduce_scatter")
"""Collectives counted from FSDP's sharding (``train.strategies.StepTraffic``) but never timed: FSDP2 calls them inside
autograd, so a rank's busy time includes them."""


def _cpu_need(fits: list[_Point], compute: Callable[[int], float], traffic: dict[str, dict[str, float]],
              net: Net) -> Callable[[int], float] | None:
    """CPU seconds one rank's process needs per step at N (all its threads), from the measured CPU time; None
    where it was not measured.

    Computing takes the CPU it took at the smallest size fitted on (per second of its busy time there), scaled as
    the fitted compute; the collectives' own CPU (copies, reductions, socket wake-ups: the rest of a rank's CPU
    at the largest size fitted on, beside its busy time's computing, or beside the scaled computing where the busy
    time holds collectives it did not time: :data:`UNTIMED_KINDS`) grows with the messages a rank waits for
    (:func:`_hops`)."""
    first, last = fits[0], fits[-1]
    if any(p.cpu_mean_s is None or not p.compute_mean_s for p in fits):
        return None
    base = compute(first.n)

    def computing(n: int) -> float:
        """The CPU of computing at N: the first size's, scaled as the fitted compute."""
        return first.cpu_mean_s * (compute(n) / base if base > 0 else 1.0)

    if any(key.partition(":")[0] in UNTIMED_KINDS for key in traffic):
        # the busy time holds collectives it never timed (FSDP's, inside autograd): the CPU beyond computing's is
        # the collectives'
        computing_last = computing(last.n)
    else:  # the busy time is computing alone: its CPU per second of busy time at the first size
        computing_last = last.compute_mean_s * first.cpu_mean_s / first.compute_mean_s
    comm_cpu = max(0.0, last.cpu_mean_s - computing_last) if last.n > first.n else 0.0
    hops_last = _hops(traffic, last.n, net)

    def need(n: int) -> float:
        grown = comm_cpu * _hops(traffic, n, net) / hops_last if hops_last > 0 else comm_cpu
        return computing(n) + grown

    return need


def _shards(points: dict[int, _Point], sizes: Sequence[int], per_node: int | None,
             given: bool) -> tuple[Shards | None, str | None]:
    """HSDP's shard group at each N, and the assumption that says how (None, None: not an HSDP job).

    Measured sizes keep their own; elsewhere a chosen ``hsdp_shard_size`` stays, and the default (the ranks per
    node) is ``per_node`` (``given``: by ``--ranks-per-node``); None: every rank, on this one host."""
    hsdp = [p for p in points.values() if p.shard_size]
    if not hsdp:
        return None, None
    chosen = max((p for p in hsdp if p.shard_set), key=lambda p: p.n, default=None)
    chosen = chosen.shard_size if chosen else None
    if chosen:
        rule = f"hsdp_shard_size={chosen}, as the job sets it"
    elif per_node:
        rule = f"the {per_node} ranks of a node ({'--ranks-per-node' if given else 'by default; --ranks-per-node sets it'})"
    else:
        rule = "every rank (one host: the ranks per node)"
    size = chosen or per_node

    def shards(n: int) -> int:
        if n in points and points[n].shard_size:
            return min(points[n].shard_size, n)  # a 1-rank run names the shard size it was given
        return min(size, n) if size else n

    for n in sizes:
        if n % shards(n):
            raise ConfigError(f"--predict {n}: an hsdp replica is sharded over {shards(n)} ranks ({rule}), which does "
                              f"not divide {n}; valid: world sizes that are multiples of {shards(n)}")
    return shards, (f"hsdp: each replica is sharded over {rule}; its all-gathers and reduce-scatters run over those "
                    "ranks and the gradient shards' all-reduce over the replicas")


def row_label(row: dict[str, Any]) -> str:
    """A predicted row's world size as tables show it: ``64``, or ``64 (8 x 8)`` for hsdp (replicas x ranks each)."""
    layout = row.get("hsdp")
    return f"{row['world_size']} ({layout[0]} x {layout[1]})" if layout else str(row["world_size"])


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def predict(runs: Sequence[dict[str, Any]], sizes: Sequence[int], link: Link, *, scaling: str = "strong",
            cores: int | None = None, cpu_ranks: bool = False, threads: int | None = None,
            other_work: float = 0.0, ranks_per_node: int | None = None,
            node_link: Link | None = None, fit_on: Sequence[int] | None = None) -> dict[str, Any]:
    """Predicted rows at ``sizes`` from bench runs (``[{"world_size": N, "summary": {...}}, ...]``).

    ``cpu_ranks``: the ranks computed on this host's CPU; with ``link.source == "measured"`` on loopback the
    prediction is for this host, whose ``cores`` the ranks share (``threads`` each; default ``cores // N``) with
    ``other_work`` cores busy with other processes (:func:`busy_cores`). ``ranks_per_node``: the ranks of one node
    at the predicted sizes (an HSDP job's default shard group: see :func:`_shards`). ``node_link``: the link among
    the ranks of one node, for collectives that stay within a node (``link`` is then the network between nodes).
    ``fit_on``: the measured sizes to fit on (default: those below the smallest predicted, :func:`fit_sizes`);
    ``multigpu plan`` fits on every measured size and predicts any, measured ones included.
    """
    by_size: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        by_size.setdefault(int(run["world_size"]), []).append(run["summary"])
    fit_on = tuple(sorted(fit_on)) if fit_on else fit_sizes(list(by_size), sizes)
    points = {n: _point(n, by_size[n]) for n in by_size}
    fits = [points[n] for n in fit_on]
    base = points[min(by_size)]
    on_host = cpu_ranks and link.name == LOOPBACK_NAME and cores
    # nodes at the predicted sizes: this host alone on loopback, else GPU nodes of 8 unless given
    per_node = ranks_per_node or (None if link.name == LOOPBACK_NAME else 8)
    shards, hsdp_rule = _shards(points, sizes, per_node, given=ranks_per_node is not None)
    net = Net(link, node_link if per_node else None, per_node, shards)

    def threads_at(n: int) -> int:
        return threads or max(1, (cores or 1) // n)

    # a rank holds its cores only while it computes, not while it waits in a collective: the share of its step
    # outside collectives, as at the largest size fitted on (1 where that was not measured)
    held = fits[-1].compute_mean_s / fits[-1].step_s if fits[-1].compute_mean_s and fits[-1].step_s else 1.0
    held = min(max(held, 0.0), 1.0)

    def crowding(n: int) -> float:
        """How much slower a rank computes because the ranks' threads outnumber this host's cores."""
        busy = n * threads_at(n) * (held if n > 1 else 1.0)
        return max(1.0, (busy + other_work) / cores) if on_host else 1.0

    with_traffic = [p for p in fits if p.n >= 2]
    traffic_from = with_traffic[-1] if with_traffic else None
    traffic = traffic_from.traffic if traffic_from else {}
    # the slowest rank's compute: the measured step minus the modelled communication. Not the ranks' busy time:
    # an overlapped all-reduce (DDP's) is timed over the backward it overlaps, so busy time under-counts compute
    computes = [max(p.step_s - sum(comm_time(traffic, p.n, net)), 0.0) for p in fits]
    last, first = fits[-1], fits[0]
    # items per step grow as N ** growth: 0 when the global problem is fixed, 1 when each rank's share is (a
    # workload whose per-rank batch is set, even under strong scaling); measured where two sizes were fitted
    if last.n > first.n and first.items_per_step > 0 and last.items_per_step > 0:
        growth = math.log(last.items_per_step / first.items_per_step) / math.log(last.n / first.n)
    else:
        growth = 1.0 if scaling == "weak" else 0.0

    def per_rank(n: int) -> float:
        """Items per rank per step at N."""
        return last.items_per_step * (n / last.n) ** growth / n

    # compute = a + b x, x = the items each rank handles per step: a is what no split shares (the replicated
    # part), b the cost of one item
    norm = [c / crowding(p.n) for c, p in zip(computes, fits, strict=True)]
    a, b = _fit([per_rank(p.n) for p in fits], norm)
    imbalance = (last.compute_max_s / last.compute_mean_s
                 if last.compute_max_s and last.compute_mean_s else 1.0)
    cpu_need = _cpu_need(fits, lambda n: a + b * per_rank(n), traffic, net) if on_host else None
    free_cores = max(float(cores or 1) - other_work, 1.0)
    rows = []
    for n in sizes:
        slow = (a + b * per_rank(n)) * crowding(n)
        compute = slow / imbalance  # the mean rank's; the rest is waiting for the slowest
        latency, bandwidth = comm_time(traffic, n, net)
        step = slow + latency + bandwidth
        # the cores' bound: N ranks cannot finish a step before the cores free to them have run the CPU it needs
        waiting = max(0.0, n * cpu_need(n) / free_cores - step) if cpu_need else 0.0
        step += waiting
        items = per_rank(n) * n
        throughput = items / step if step > 0 else 0.0
        base_throughput = base.items_per_step / base.step_s if base.step_s > 0 else 0.0
        speedup = throughput / base_throughput if base_throughput > 0 else 0.0
        parts = {"compute": compute, "imbalance": slow - compute, "latency": latency, "bandwidth": bandwidth,
                 "cores": waiting}
        row = {"world_size": n, "step_time_s": step, "throughput": throughput, "speedup": speedup,
               "ideal": n / base.n, "efficiency": speedup / (n / base.n), **{f"{k}_s": v for k, v in parts.items()},
               "bottleneck": max(parts, key=parts.get), "measured_step_time_s": None, "error": None}
        if shards:  # hsdp: replicas x ranks per replica
            row["hsdp"] = [n // shards(n), shards(n)]
        if n in points:
            row["measured_step_time_s"] = points[n].step_s
            row["error"] = step / points[n].step_s - 1 if points[n].step_s > 0 else None
        rows.append(row)
    return {
        "sizes": list(sizes),
        "fit_on": list(fit_on),
        "link": asdict(link),
        "compute_fit": {"held_share": held, "fixed_s": a, "per_item_s": b, "items_per_rank": {n: per_rank(n) for n in sizes},
                        "imbalance": imbalance,
                        "measured_s": {p.n: c for p, c in zip(fits, computes, strict=True)}},
        "traffic": traffic,
        "traffic_at": traffic_from.n if traffic_from else None,
        "rows": rows,
        "assumptions": _assumptions(link, fit_on, growth, a, b, imbalance, traffic_from, on_host, cores,
                                    threads_at, other_work, held, cpu_need is not None)
                       + _network(net) + ([hsdp_rule] if hsdp_rule else []),
        "cannot_know": CANNOT_KNOW,
    }


LOOPBACK_NAME = "this host's gloo over loopback"

CANNOT_KNOW = [
    "the topology: which ranks share a node, a switch or a link, and how many hops lie between them",
    "congestion: other jobs on the network, and stragglers (a slow node or GPU sets everyone's pace)",
    "the algorithm the collective library picks at each size (the faster of ring and tree is assumed)",
    "compute that changes with the shard: a smaller batch per rank often runs below the measured rate",
    "memory: whether the job fits at that size (multigpu's --dry-run checks that)",
]


def _network(net: Net) -> list[str]:
    """What the prediction assumes of nodes (nothing where one link carries every collective)."""
    if net.node_link is None:
        return []
    return [f"nodes of {net.per_node} ranks: a collective among the ranks of one node runs on {net.node_link.name} "
            f"(latency {net.node_link.alpha_s * 1e6:.3g} us, {net.node_link.bandwidth / 1e9:.3g} GB/s), one that "
            f"spans nodes at the pace of {net.link.name} (no hierarchical algorithm is assumed)"]


def _assumptions(link: Link, fit_on, growth, a, b, imbalance, traffic_from, on_host, cores, threads_at,
                 busy, held, cpu_model) -> list[str]:
    out = [f"interconnect: {link.name}, latency {link.alpha_s * 1e6:.3g} us and {link.bandwidth / 1e9:.3g} GB/s per "
           f"rank and direction ({link.source})"]
    sizes = ", ".join(map(str, fit_on))
    out.append(f"compute per step fitted on N = {sizes}: {a * 1e3:.3g} ms + {b * 1e6:.3g} us per item a rank "
               f"handles per step (items per step grow as N^{growth:.2g}, as measured; the first part does not "
               "shrink with more ranks)")
    out.append("compute per step = the measured step time minus the modelled communication (time the model does not "
               "explain, such as waiting for a core or an overlapped all-reduce, counts as compute)")
    out.append("step time: the slowest rank's mean over the measured steps (the pace throughput and speedup come "
               "from), measured and predicted alike")
    out.append(f"load imbalance: the slowest rank computes {imbalance:.2f}x the mean, as at N = {fit_on[-1]}")
    if on_host:
        out.append(f"ranks share this host's {cores} cores ({threads_at(fit_on[-1])} thread(s) per rank at "
                   f"N = {fit_on[-1]}) with {busy:.2g} core(s) of other work (as sampled during the fitted runs); a "
                   f"rank holds its cores {held:.0%} of its step (outside collectives, as at N = {fit_on[-1]}): "
                   "beyond the cores compute slows by (N x threads x that share + other work) / cores")
        if cpu_model:
            out.append("and a step takes at least N x the CPU one rank needs per step / the cores free of other "
                       "work: computing as at the fitted sizes, plus the collectives' own CPU (copies, reductions, "
                       f"wake-ups) as measured at N = {fit_on[-1]}, growing with the messages a rank waits for")
    else:
        out.append("each added rank computes as fast as a measured one (on its own device)")
    if traffic_from is None:
        out.append("communication: none measured (fit on 1 rank only): the prediction counts compute alone; "
                   "bench at 2 ranks or more to count the job's collectives")
    else:
        kinds = ", ".join(f"{k} {v['calls']:.3g} call(s) {v['bytes'] / 1e6:.3g} MB" for k, v in
                          traffic_from.traffic.items()) or "none"
        out.append(f"communication per step: the job's own collectives counted at N = {traffic_from.n} ({kinds}); "
                   "each keeps that message size at every N (true of gradient all-reduces and halos; a gather of a "
                   "fixed result shrinks with N, so its time is over-estimated)")
    out.append("collectives: the faster of ring and tree per call; all-to-all and gathers assume full bisection "
               "bandwidth; communication does not overlap compute (DDP overlaps its all-reduce with the backward "
               "pass, so a real step can be faster)")
    return out
