"""The scaling table and its plain-words verdicts (pure; runs in the launcher).

``scaling_rows(runs)`` turns the ``summary.json`` of every run (one per world
size and repeat, written by ``StepMeter``) into one row per world size;
``explain(rows)`` says, in words, where more ranks did not pay and why, from
the measured communication share, load imbalance and compute time per item.

Definitions (baseline = the smallest world size benched):

* *throughput* - items/s of the whole job (min and median over repeats);
* *speedup* - median throughput / the baseline's;
* *ideal* - world_size / baseline world_size;
* *efficiency* - speedup / ideal (1.0 = perfect scaling);
* *comm share* - time in collectives / step time, averaged over ranks (median over repeats);
* *imbalance* - slowest rank's busy time / fastest's (median over repeats);
* *compute per item* - busy (non-communication) seconds of all ranks / items:
  it grows when ranks compete for the same cores or memory bandwidth;
* *rank CPU* - a rank's mean CPU use in % of one core, from the device sampler
  (``None`` without samples); far below the rank's threads x 100% means it waited
  for cores that other processes held.

A figure that was not measured is ``None`` (in the rows and in ``bench.json``), never 0: a script timed by
its wall clock measures no communication share, imbalance or compute per item, and a meter may not measure
communication on some backends. The table prints it as :data:`multigpu.units.NOT_MEASURED`; the verdicts name no cause
from it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from multigpu.units import fmt_rate, shown

__all__ = ["distrust", "explain", "scaling_rows", "startup_rows", "superlinear"]

COMM_NOTABLE = 0.2
"""A communication share at or above this is named as a cause."""
IMBALANCE_NOTABLE = 1.2
"""A load imbalance at or above this is named as a cause."""
CONTENTION_NOTABLE = 1.2
"""Compute per item growing by this factor over the baseline is named as a cause."""
EFFICIENCY_GOOD = 0.7
"""Below this efficiency a row gets an explanation even when it was faster."""
SUPERLINEAR = 1.3
"""Above this efficiency a row is called faster than ideal: NOISY on CPU ranks (N processes sharing one host's
cores cannot do more than N times one's work unless the one was held back), explained on GPUs."""
UNSTEADY = 2.0
"""A run whose items/s moved more than this factor between quarters of its measured steps is called noisy."""
MIN_STEPS = 5
"""Fewer measured steps (after warm-up) than this make a run too short to stand behind."""
BUSY_HOST_CORES = 0.5
"""Cores the host spent beyond the job's own ranks, on average, from which the host is called busy."""
WALL_IMPLAUSIBLE = 2.0
"""A wall-clock-timed world size this many times faster than its ideal speedup is start-up or load noise."""
STARVED_RANK = 70.0
"""On CPU ranks: a rank using less than this % of one core while it computes (the non-communication
share of its time) was kept waiting for a core by other processes."""


def _median_measured(values) -> float | None:
    """The median, or None when any run did not measure it (a mix would pass off part of the runs as all)."""
    values = list(values)
    return None if not values or any(v is None for v in values) else statistics.median(values)


def _compute_per_item(summary: dict[str, Any]) -> float | None:
    per_rank = summary.get("per_rank") or []
    if any(r.get("busy_s") is None for r in per_rank):
        return None  # comm not measured, so neither is the compute
    busy = sum(r["busy_s"] for r in per_rank)
    items = sum(r.get("items", 0) for r in per_rank)
    return busy / items if items else None


def _median_of(runs: Sequence[dict[str, Any]], size: int, key: str) -> float | None:
    values = [r["cpu"][key] for r in runs if int(r["world_size"]) == size and r.get("cpu")]
    return statistics.median(values) if values else None


def scaling_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per world size (ascending) from ``[{"world_size": N, "summary": {...}}, ...]``."""
    by_size: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        by_size.setdefault(int(run["world_size"]), []).append(run["summary"])
    if not by_size:
        return []
    rows = []
    for size in sorted(by_size):
        sums = by_size[size]
        throughputs = [s["throughput"] for s in sums]
        rows.append({
            "world_size": size,
            "repeats": len(sums),
            "measure": "wall" if any(s.get("measure") == "wall" for s in sums) else "meter",
            "throughput_min": min(throughputs),
            "throughput_median": statistics.median(throughputs),
            "step_time_s": statistics.median(s["step_time_s"]["median"] for s in sums),
            "comm_share": _median_measured(s.get("comm_share") for s in sums),
            "imbalance": _median_measured(s.get("imbalance") for s in sums),
            "compute_per_item_s": _median_measured(_compute_per_item(s) for s in sums),
            "rank_cpu_percent": _median_of(runs, size, "rank_percent"),
            "host_cpu_percent": _median_of(runs, size, "host_percent"),
            "doubts": _row_doubts([r for r in runs if int(r["world_size"]) == size]) + _repeat_doubts(throughputs),
            # ranks persistently slower than the others in any repeat (None: not measured in any)
            "stragglers": _stragglers_of(sums),
        })
    base = rows[0]
    for row in rows:
        row["ideal"] = row["world_size"] / base["world_size"]
        row["speedup"] = row["throughput_median"] / base["throughput_median"] if base["throughput_median"] > 0 else 0.0
        row["efficiency"] = row["speedup"] / row["ideal"]
    return rows


def _stragglers_of(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]] | None:
    found = [s.get("stragglers") for s in summaries]
    if all(f is None for f in found):
        return None
    return [x for f in found if f for x in f]


def doubts(run: dict[str, Any], cores: int | None = None) -> list[str]:
    """Why one run's figure cannot be trusted (empty: no reason found)."""
    summary, out = run["summary"], []
    if summary.get("measure") != "wall" and summary.get("steps", MIN_STEPS) < MIN_STEPS:
        out.append(f"only {summary.get('steps')} measured step(s) after warm-up")
    quarters = [q for q in summary.get("quarters") or [] if q > 0]
    if len(quarters) == 4 and max(quarters) > UNSTEADY * min(quarters):
        out.append(f"its rate moved {max(quarters) / min(quarters):.1f}x during the run "
                   f"({', '.join(f'{q:,.0f}' for q in quarters)} {summary.get('unit', 'items')}/s by quarter)")
    out += _wall_doubts(summary)
    cpu = run.get("cpu")
    if cpu and cores:
        others = cpu["host_percent"] / 100 * cores - cpu["rank_percent"] / 100 * int(run["world_size"])
        if others > BUSY_HOST_CORES:
            out.append(f"the host was busy: {others:.1f} core(s) of other work beside the job")
    return out


def _wall_doubts(summary: dict[str, Any]) -> list[str]:
    """A wall-clock-timed run whose ranks did not run alike: their times or their starts far apart."""
    if summary.get("measure") != "wall":
        return []
    out = []
    walls = [r["wall_s"] for r in summary.get("per_rank") or [] if r.get("wall_s")]
    if len(walls) > 1 and max(walls) > UNSTEADY * min(walls):
        out.append(f"its ranks' run times ranged from {min(walls):.2f} s to {max(walls):.2f} s")
    skew, wall = summary.get("start_skew_s"), summary.get("wall_s")
    if skew is not None and wall and skew > wall / UNSTEADY:
        out.append(f"its ranks started {skew:.2f} s apart, in a {wall:.2f} s run")
    return out


def _repeat_doubts(throughputs: Sequence[float]) -> list[str]:
    """A world size whose repeats measured rates far apart."""
    low, high = min(throughputs), max(throughputs)
    if len(throughputs) > 1 and low > 0 and high > UNSTEADY * low:
        return [f"its rate moved {high / low:.1f}x between repeats ({', '.join(fmt_rate(t) for t in throughputs)})"]
    return []


def _row_doubts(runs: Sequence[dict[str, Any]]) -> list[str]:
    """A world size's doubts: those of every one of its runs (with repeats, one good run is not enough to
    trust the median: the flags of each are kept, once)."""
    seen: list[str] = []
    for run in runs:
        for d in run.get("doubts", []):
            if d not in seen:
                seen.append(d)
    return seen


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def superlinear(row: dict[str, Any], cpu_ranks: bool) -> str | None:
    """Why a row faster than ideal on CPU ranks is not believed (None: it is not, or the ranks are GPUs, where a
    share that fits in a GPU's memory or cache can make it real). N processes on one host's cores cannot do
    more than N times the work of one unless the one was held back: the baseline, not the scaling, is off."""
    if not cpu_ranks or row["efficiency"] <= SUPERLINEAR:
        return None
    return (f"{row['speedup']:.2f}x on {_ranks(row['world_size'])} of CPU ranks, beyond the ideal {row['ideal']:.0f}x: "
            "a measurement problem until shown otherwise")


def distrust(rows: Sequence[dict[str, Any]], sizes: Sequence[int], *, cpu_ranks: bool) -> list[str]:
    """Why the rows of world sizes ``sizes`` (those a prediction is fitted on) cannot be trusted: their doubts
    and a faster-than-ideal result on CPU ranks, each once (empty: nothing known against them)."""
    reasons: list[str] = []
    for row in rows:
        if row["world_size"] not in sizes:
            continue
        for reason in [*row.get("doubts", []), superlinear(row, cpu_ranks)]:
            text = reason and f"{_ranks(row['world_size'])}: {reason}"
            if text and text not in reasons:
                reasons.append(text)
    return reasons


def _causes(row: dict[str, Any], base: dict[str, Any], cores: int | None) -> list[str]:
    """Measured reasons a row scales worse than ideal, the largest first."""
    n = _ranks(row["world_size"])
    found: list[tuple[float, str]] = []
    if row["comm_share"] is not None and row["comm_share"] >= COMM_NOTABLE:
        found.append((row["comm_share"],
                      f"communication is {row['comm_share']:.0%} of step time at {n} "
                      f"({shown(base['comm_share'], '.0%')} at {_ranks(base['world_size'])}; time inside collectives, "
                      "including waiting for the other ranks to arrive)"))
    if row["imbalance"] is not None and row["imbalance"] >= IMBALANCE_NOTABLE:
        found.append((row["imbalance"] - 1,
                      f"load imbalance: at {n} the slowest rank computed {row['imbalance']:.2f}x as long as the "
                      "fastest (the others wait for it in every collective)"))
    if row["compute_per_item_s"] and base["compute_per_item_s"]:
        growth = row["compute_per_item_s"] / base["compute_per_item_s"]
        if growth >= CONTENTION_NOTABLE:
            where = f" (this machine has {cores} cores)" if cores else ""
            found.append((growth - 1,
                          f"each item took {growth:.2f}x as much compute time as at {_ranks(base['world_size'])}: "
                          f"the ranks compete for the same cores or memory bandwidth{where}"))
    return [text for _, text in sorted(found, key=lambda f: -f[0])]


def straggler_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """``STRAGGLER: at 2 ranks, rank 1 (node 0, host h) is 3.10x slower ...``: one note per rank named in a run."""
    from multigpu.monitor.stragglers import describe

    return [f"STRAGGLER: at {_ranks(row['world_size'])}, {describe(s)}: the others wait for it at every step; "
            "check that rank's device, its cores and what else runs there"
            for row in rows for s in row.get("stragglers") or []]


def explain(rows: Sequence[dict[str, Any]], *, cores: int | None = None, cpu_ranks: bool = True) -> list[str]:
    """Plain-words verdicts: where more ranks made the job slower (or scaled poorly), and the measured why.

    ``cpu_ranks``: the ranks computed on the CPU, so their CPU use shows whether they got the cores.
    """
    named = straggler_notes(rows)
    if len(rows) < 2:
        return named
    base = rows[0]
    notes = named
    for prev, row in zip(rows, rows[1:], strict=False):
        n, m = _ranks(row["world_size"]), _ranks(prev["world_size"])
        doubtful = [f"{_ranks(r['world_size'])}: {d}" for r in (prev, row) for d in r.get("doubts", [])]
        if row.get("measure") == "wall" and row["efficiency"] > WALL_IMPLAUSIBLE:
            doubtful.append(f"{n} ran {row['speedup'] / prev['speedup']:.1f}x faster than {m} by the wall clock, "
                            f"beyond {WALL_IMPLAUSIBLE:.0f}x the ideal: start-up or load, not scaling")
        if doubtful:
            notes.append(f"NOISY: {n} vs {m} ({row['speedup'] / prev['speedup']:.2f}x measured) cannot be trusted: "
                         f"{'; '.join(doubtful)}. Rerun with --repeat 3 (world sizes alternate) on a quieter machine.")
            continue
        causes = _causes(row, base, cores)
        why = "; ".join(causes) if causes else (
            "no single cause stands out in the measurements: fixed per-step or start-up overheads dominate; "
            "try more steps or a larger problem")
        if row["efficiency"] > SUPERLINEAR:
            growth = (row["compute_per_item_s"] / base["compute_per_item_s"]
                      if row["compute_per_item_s"] and base["compute_per_item_s"] else None)
            seen = f": each item took {growth:.2f}x the compute time it took at {_ranks(base['world_size'])}" \
                if growth else ""
            if superlinear(row, cpu_ranks):  # CPU ranks: not believed (and no prediction is fitted on it)
                notes.append(f"NOISY: {n}: {row['speedup']:.2f}x speedup, faster than the ideal "
                             f"{row['ideal']:.0f}x{seen}. On CPU ranks that is a measurement problem until shown "
                             "otherwise: the baseline ran slower per item than its share of the machine allows (its "
                             "threads waited for cores other processes held). Rerun with --repeat 3 (world sizes "
                             "alternate) on a quieter machine.")
                continue
            notes.append(f"{n}: {row['speedup']:.2f}x speedup, faster than the ideal {row['ideal']:.0f}x{seen}. "
                         f"The baseline ran slower per item than its share of the machine allows "
                         "(its threads waited for cores, or its data did not fit in cache).")
            continue
        if row["throughput_median"] < prev["throughput_median"]:
            ratio = row["throughput_median"] / prev["throughput_median"] if prev["throughput_median"] else 0.0
            notes.append(f"SLOWER: {n} ran slower than {m} ({ratio:.2f}x the throughput): {why}.")
        elif row["efficiency"] < EFFICIENCY_GOOD:
            notes.append(f"{n}: {row['speedup']:.2f}x speedup of an ideal {row['ideal']:.0f}x "
                         f"({row['efficiency']:.0%} efficiency): {why}.")
        else:
            notes.append(f"{n}: {row['speedup']:.2f}x speedup ({row['efficiency']:.0%} efficiency).")
    # a rank's CPU use is judged against its computing share of time: unknown without a measured comm share
    # ... and against its share of the cores: more ranks than cores (3 on 2) get cores/N each from one another,
    # which is the job's own crowding, not other processes
    def share(r: dict[str, Any]) -> float:
        return min(1.0, cores / r["world_size"]) if cores else 1.0

    starved = [r for r in rows if cpu_ranks and r.get("rank_cpu_percent") is not None and r["comm_share"] is not None
               and r["rank_cpu_percent"] < STARVED_RANK * (1 - r["comm_share"]) * share(r)]
    if starved:
        which = ", ".join(f"{_ranks(r['world_size'])}: {r['rank_cpu_percent']:.0f}% of a core per rank, "
                          f"host {r['host_cpu_percent']:.0f}%" for r in starved)
        notes.append(f"CAUTION: ranks got less CPU than their work needed ({which}): other processes held the "
                     "cores, so these figures are noisy; repeat with --repeat 3 or on an idle machine.")
    return notes


def startup_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Where start-up went, one row per world size (ascending): each part's median over the repeats that measured
    it, the median time from the command to the first step, and the workers' ``import torch`` (the floor of a
    worker's start). Runs whose summary has no ``startup`` (written before it existed) are left out."""
    by_size: dict[int, list[dict[str, Any]]] = {}
    for run in runs:
        found = run["summary"].get("startup")
        if found:
            by_size.setdefault(int(run["world_size"]), []).append(found)
    rows = []
    for size in sorted(by_size):
        found = by_size[size]
        names = [p for p in _startup_part_names() if any(p in s.get("parts_s", {}) for s in found)]
        rows.append({
            "world_size": size,
            "parts_s": {p: _median_measured(s.get("parts_s", {}).get(p) for s in found) for p in names},
            "to_first_step_s": _median_measured(s.get("to_first_step_s") for s in found),
            "first_step_s": _median_measured(s.get("first_step_s") for s in found),
            "torch_import_s": _median_measured(s.get("torch_import_s") for s in found),
        })
    return rows


def _startup_part_names() -> list[str]:
    from multigpu.monitor.startup import PARTS

    return [name for name, _, _ in PARTS]
