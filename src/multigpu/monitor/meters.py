"""Step meters every workload uses: step time, items/s, communication time, load imbalance.

Runs inside each rank. A workload names its unit (samples, tokens, agents,
windows, env-steps) and wraps each step::

    meter = StepMeter("tokens", total_steps=steps, description="train")
    for step in range(steps):
        with meter.step(items=tokens_this_rank):
            ...                                  # forward, backward, optimizer
    summary = meter.close()                      # call on all ranks; rank 0 writes summary.json

    meter = StepMeter.from_context("samples")    # the launcher's run: its folder, device sampler, --profile

Definitions (per rank, over the measured steps, i.e. after ``warmup_steps``):

* *wall* - time inside ``step()`` blocks. On CUDA a step is bracketed by two
  timing events on the current stream, and its time is the GPU's between them:
  the kernels it queued, not only the time to queue them. The host does not
  wait at the step's end: each step's events are read one step later (by then
  the GPU has run it), so the host queues step k+1 while the GPU runs step k.
  The figures of a step are therefore recorded when the next step ends (or at
  ``flush()``, a log point, ``summary()``/``close()``);
* *comm* - time spent in multigpu's collectives during those steps (device time
  from CUDA events for CUDA tensors), plus what the workload adds with
  ``add_comm()`` (e.g. a DDP communication hook). ``add_comm(None)`` says the
  step had communication nobody could time (DDP's NCCL all-reduce): comm, comm
  share, busy and imbalance are then ``None`` ("not measured"), never 0;
* *busy* - wall minus comm: the compute this rank did;
* *throughput* - items of all ranks / the slowest rank's wall time;
* *comm share* - comm / wall, averaged over ranks;
* *load imbalance* - the slowest rank's busy time / the fastest's (1.0 = even);
* *traffic* - per collective kind, the calls and bytes per step of the busiest rank
  (``collectives.record_traffic``: what ``multigpu bench --predict`` extrapolates);
* *startup* - where the time from the command to the first step went, in parts
  (:mod:`multigpu.monitor.startup`).

Metrics are reduced across ranks (one small collective at each log point, and
at ``close()``) and only rank 0 writes: ``metrics.jsonl`` (one record per log
point: every ``log_every``-th step as the run counts them, and the steps a
workload marks; see :mod:`multigpu.monitor.metrics`) and ``summary.json`` in
``run_dir`` (None: nothing is written).
A meter is given its run directory, device sampler and profiler explicitly;
:meth:`StepMeter.from_context` takes all three from the launcher's run
context (:mod:`multigpu.runtime.context`: the run directory ``multigpu bench``
chose, ``--profile``, the sampling interval). ``close()`` stops both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from multigpu.files import write_json_atomic
from multigpu.monitor import profile, startup, stragglers
from multigpu.monitor import sampler as _sampler
from multigpu.monitor.metrics import MetricsLog, sum_comm
from multigpu.runtime import collectives, context, devicetime, group, watchdog

__all__ = ["StepMeter", "write_json_atomic"]


class _Progress:
    """A rich progress bar on rank 0 with items/s and ETA; nothing when output is not a terminal."""

    def __init__(self, description: str, total: int | None, unit: str, enabled: bool):
        self.bar = None
        if not (enabled and group.rank() == 0 and sys.stderr.isatty()):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"), TimeRemainingColumn(), transient=False,
        )
        self.task = self.bar.add_task(description, total=total, rate="")
        self.unit = unit
        self.bar.start()

    def advance(self, rate: float | None, extra: str = "") -> None:
        if self.bar is not None:
            text = f"{rate:,.0f} {self.unit}/s" if rate else ""
            self.bar.update(self.task, advance=1, rate=f"{text} {extra}".strip())

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


@dataclasses.dataclass
class _Queued:
    """A CUDA step the host has queued, read one step later: its events, and what was known at its end."""

    begin: Any
    end: Any
    comm_from: tuple[float, int]
    comm_to: tuple[float, int]
    extra: float | None
    cpu_s: float
    items: int
    traffic: dict[str, tuple[int, int]]


@dataclasses.dataclass
class StepCount:
    """The items of the step in progress (``StepMeter.step`` yields it)."""

    items: int = 0


def _quarters(step_times: list[float], step_items: list[int]) -> list[float] | None:
    """Items/s of the job in each quarter of the measured steps (None below 4 steps): a run whose rate moved a
    lot from quarter to quarter measured something besides the workload (``multigpu bench`` says so)."""
    n = min(len(step_times), len(step_items))
    if n < 4:
        return None
    out = []
    for q in range(4):
        lo, hi = q * n // 4, (q + 1) * n // 4
        wall = sum(step_times[lo:hi])
        out.append(sum(step_items[lo:hi]) / wall if wall > 0 else 0.0)
    return out


def _delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    out = {}
    for kind, (calls, nbytes) in after.items():
        c0, b0 = before.get(kind, (0, 0))
        if calls > c0:
            out[kind] = (calls - c0, nbytes - b0)
    return out


def _per_step(steps: list[dict[str, tuple[int, int]]]) -> dict[str, dict[str, float]]:
    """``{kind: {"calls": per step, "bytes": per step}}`` averaged over ``steps``."""
    total: dict[str, list[int]] = {}
    for step in steps:
        for kind, (calls, nbytes) in step.items():
            entry = total.setdefault(kind, [0, 0])
            entry[0] += calls
            entry[1] += nbytes
    n = max(len(steps), 1)
    return {kind: {"calls": c / n, "bytes": b / n} for kind, (c, b) in sorted(total.items())}


def _busiest(ranks) -> dict[str, dict[str, float]]:
    """Per kind, the most calls and bytes any rank made per step (the rank the others wait for)."""
    out: dict[str, dict[str, float]] = {}
    for rank in ranks:
        for kind, fig in rank.items():
            have = out.setdefault(kind, {"calls": 0.0, "bytes": 0.0})
            have["calls"], have["bytes"] = max(have["calls"], fig["calls"]), max(have["bytes"], fig["bytes"])
    return out


def _place() -> tuple[int, str]:
    """This rank's node and host name (how a straggler is named)."""
    import socket

    return group.node_rank(), socket.gethostname()


class StepMeter:
    """Measures a workload's steps on every rank and reduces them; see the module docstring.

    Args:
        unit: What one item is ("samples", "tokens", "agents", "windows", "env-steps").
        total_steps: For the progress bar's ETA (None: no total).
        description: The progress bar's label.
        run_dir: Where rank 0 writes metrics.jsonl and summary.json (None: nowhere).
        log_every: Reduce and log every N steps as the run counts them (0: only at steps marked by :meth:`point`;
            the summary at ``close()`` either way); see :mod:`multigpu.monitor.metrics`. Every rank must run the
            same number of steps, as with any collective.
        warmup_steps: Steps left out of the summary (start-up, compilation, caches).
        progress: Show the progress bar on rank 0 when stderr is a terminal.
        sampler: A started :class:`~multigpu.monitor.sampler.Sampler` (or None) to stop at ``close()``.
        profiler: A :class:`~multigpu.monitor.profile.StepProfiler` (or None), stepped with every step.
        device: The device the steps run on (default: this rank's, from ``mg.init``; the CPU before it).
            On CUDA every step ends on an event of its current stream (see the module docstring).
    """

    def __init__(
        self,
        unit: str = "items",
        *,
        total_steps: int | None = None,
        description: str | None = None,
        run_dir: str | Path | None = None,
        log_every: int = 0,
        warmup_steps: int = 1,
        progress: bool = True,
        sampler: _sampler.Sampler | None = None,
        profiler: profile.StepProfiler | None = None,
        device: torch.device | str | None = None,
    ):
        self.unit = unit
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.log = MetricsLog(self, log_every)
        """The log points (:mod:`multigpu.monitor.metrics`): the cadence, the records, ``metrics.jsonl``."""
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.device = torch.device(device) if device is not None else None
        self.step_times: list[float] = []
        self.cpu_times: list[float] = []
        """Per step: CPU seconds this rank's process spent in it (all its threads: the collective library's too)."""
        self.comm_times: list[float | None] = []
        """Per step; None where the step's communication was not measured (``add_comm(None)``)."""
        self.items: list[int] = []
        self.traffic: list[dict[str, tuple[int, int]]] = []
        """Per step: ``{kind: (calls, bytes)}`` of the collectives this rank made in it (``collectives.traffic``)."""
        self._extra_comm: float | None = 0.0
        self._progress = _Progress(description or unit, total_steps, unit, progress)
        self.extras: dict[str, Any] = {}
        """The latest value of each workload figure (infected count, grad_norm, ...), carried into every record and
        shown on the progress bar; set by the workload. A tensor is read at log points only."""
        self.ends_own_steps = True
        """A step's end is its log point's time (when one is due); False: a run ends its steps (:meth:`end_step`,
        called by :class:`multigpu.run.Run` after its whole step)."""
        self._sampler = sampler
        self._profiler = profiler
        self._first_step: tuple[float, float] | None = None
        """Wall-clock start and end of the first step (where the run's start-up ends: ``startup`` in the summary)."""
        self._first_start: float | None = None  # the first step's wall-clock start, until its time is recorded
        self._queued: list[_Queued] = []  # CUDA steps whose events are read one step later
        self.first_step = 1
        """The number of this meter's first step as the run counts them (a resumed run's: its start + 1)."""
        self._watch: stragglers.StragglerWatch | None = None  # rank 0's, fed at log points
        self._said: set[int] = set()  # ranks named a straggler on the output so far
        self._watched = 0  # steps given to the straggler watch so far

    @classmethod
    def from_context(cls, unit: str = "items", ctx: context.RunContext | None = None, **kwargs: Any) -> StepMeter:
        """A meter for the launcher's run (its context ``ctx``, default this rank's): its run directory, the node's
        device sampler (started here, on every rank) and ``--profile``'s profiler. ``kwargs`` as the constructor."""
        ctx = ctx or context.current()
        run_dir = Path(ctx.run_dir) if ctx.run_dir is not None else None
        started = _sampler.start_for_rank(run_dir, ctx.sample_interval_s) if run_dir is not None else None
        return cls(unit, run_dir=run_dir, sampler=started, profiler=profile.profiler_for(ctx, run_dir), **kwargs)

    def add_comm(self, seconds: float | None) -> None:
        """Count ``seconds`` of communication done outside multigpu's collectives in the current step.

        None: the step communicated and the time is unknown (NCCL's queue-time futures); the step's comm is
        then not measured, rather than counted as 0."""
        if seconds is None or self._extra_comm is None:
            self._extra_comm = None
        else:
            self._extra_comm += seconds

    @property
    def log_every(self) -> int:
        """A log point every this many steps (as the run counts them; 0: at marked steps only)."""
        return self.log.log_every

    @log_every.setter
    def log_every(self, value: int) -> None:
        self.log.log_every = value

    @property
    def on_record(self) -> list[Callable[[dict[str, Any]], None]]:
        """Called on every rank with each record, once rank 0 has written it (train: its line, its trackers)."""
        return self.log.on_record

    def add(self, **figures: Any) -> None:
        """This step's ``figures`` whose mean over the steps since the last log point (and over the ranks) the next
        record holds: a loss. A tensor is summed where it is: no sync per step."""
        self.log.add(**figures)

    def point(self, **figures: Any) -> None:
        """Make the step in progress a log point, its record holding ``figures`` too (train: a validation loss)."""
        self.log.point(**figures)

    def end_step(self, step: int | None = None) -> dict[str, Any] | None:
        """After a step: its log point, when one is due (:mod:`multigpu.monitor.metrics`). Call on all ranks.
        ``step``: its number as the run counts them (default: this meter's count, from :attr:`first_step`).
        Returns the record (the job's figures, on every rank), or None."""
        if step is None:
            step = self.first_step - 1 + self.steps + len(self._queued)
        return self.log.end_step(step)

    @contextlib.contextmanager
    def step(self, items: int = 0) -> Iterator[StepCount]:
        """Time one step that processes ``items`` items on this rank. When the count is known only
        inside the step, set it on what the block receives: ``with meter.step() as s: ...; s.items = n``."""
        comm_from = collectives.comm_mark()
        traffic_before = collectives.traffic()
        self._extra_comm = 0.0
        count = StepCount(items)
        device = self.device or group.current_device()
        on_gpu = devicetime.is_async(device)
        begin = devicetime.timed_event(device) if on_gpu else None
        start, cpu_start = time.perf_counter(), time.process_time()
        if self._first_start is None:
            self._first_start = time.time()
        yield count
        cpu_s, wall = time.process_time() - cpu_start, time.perf_counter() - start
        traffic = _delta(traffic_before, collectives.traffic())
        watchdog.heartbeat(f"step {self.steps + len(self._queued) + 1} of {self.unit}")
        if self._profiler is not None:
            self._profiler.step()
        if on_gpu:  # read one step later: the host goes on queuing while the GPU runs this step
            self._queued.append(_Queued(begin, devicetime.timed_event(device), comm_from, collectives.comm_mark(),
                                        self._extra_comm, cpu_s, int(count.items), traffic))
            self._read(keep=1)
        else:
            extra = self._extra_comm
            comm = None if extra is None else collectives.comm_between(comm_from, collectives.comm_mark()) + extra
            self._record(wall, cpu_s, comm, int(count.items), traffic)
        if self.ends_own_steps:
            self.end_step()

    def flush(self) -> None:
        """Record every step still waiting for its CUDA events (waits for the GPU to run them): before reading
        ``step_times`` and the other per-step lists. Nothing to do on the CPU."""
        self._read(keep=0)

    def _read(self, keep: int) -> None:
        while len(self._queued) > keep:
            q = self._queued.pop(0)
            q.end.synchronize()  # the step before the one just queued: the GPU is (almost always) past it
            wall = q.begin.elapsed_time(q.end) / 1000.0  # milliseconds on the GPU's clock
            comm = None if q.extra is None else collectives.comm_between(q.comm_from, q.comm_to) + q.extra
            self._record(wall, q.cpu_s, comm, q.items, q.traffic)

    def _record(self, wall: float, cpu_s: float, comm: float | None, items: int,
                traffic: dict[str, tuple[int, int]]) -> None:
        if self.steps == 0 and self._first_start is not None:  # where start-up ends (on CUDA: its time on the GPU)
            self._first_step = (self._first_start, self._first_start + wall)
        self.steps += 1
        self.step_times.append(wall)
        self.cpu_times.append(cpu_s)
        self.comm_times.append(None if comm is None else min(comm, wall))
        self.traffic.append(traffic)
        self.items.append(items)
        self._progress.advance(items / wall * group.world_size() if wall > 0 else None, self._extras_text())

    def _extras_text(self) -> str:
        shown = {**{k: v for k, v in self.extras.items() if isinstance(v, (int, float))}, **self.log.shown}
        return " ".join(f"{k} {v:.4g}" for k, v in shown.items())  # a tensor is not read for the bar

    def _measured(self) -> slice:
        return slice(min(self.warmup_steps, max(len(self.step_times) - 1, 0)), None)

    def watch_stragglers(self) -> None:
        """Each rank's busy seconds since the last call, to rank 0's straggler watch, which names a rank that stays
        slower than the others (:mod:`multigpu.monitor.stragglers`). Every log point calls it; a workload that
        logs by itself calls it at its own log points. Call on all ranks, at the same step (one small all-reduce;
        a rank whose communication was not measured makes it judge nothing)."""
        world = group.world_size() if group.is_initialized() else 1
        last_step = self._watched
        if world < 2 or self.steps <= last_step:
            return
        self._watched = self.steps
        busy = sum(self.step_times[last_step:]) - sum_comm(self.comm_times[last_step:])
        if self._watch is None:
            places = [r["place"] for r in collectives.all_gather({"place": _place()})]
            self._watch = stragglers.StragglerWatch(world, nodes=[p[0] for p in places], hosts=[p[1] for p in places])
        window = torch.zeros(world, dtype=torch.float64)
        window[group.rank()] = busy
        window = collectives.all_reduce(window, "sum", check_shapes=False)
        if group.rank() != 0 or bool(torch.isnan(window).any()):
            return
        offset = self.first_step - 1
        for named in self._watch.feed(last_step + 1 + offset, self.steps + offset, window.tolist()):
            self._say(named.as_dict())

    def _say(self, straggler: dict[str, Any]) -> None:
        """Rank 0 names a straggler on its output (the run's log), once per rank."""
        if straggler["rank"] not in self._said:
            self._said.add(straggler["rank"])
            print(f"multigpu: straggler: {stragglers.describe(straggler)}", flush=True)

    def summary(self) -> dict[str, Any]:
        """The reduced figures over the measured steps, on every rank. Call on all ranks."""
        self.flush()
        m = self._measured()
        comm_s = sum_comm(self.comm_times[m])
        mine = {
            "wall_s": sum(self.step_times[m]),
            "cpu_s": sum(self.cpu_times[m]),
            "comm_s": None if comm_s != comm_s else comm_s,  # NaN: not measured
            "items": sum(self.items[m]),
            "steps": len(self.step_times[m]),
            "step_times": self.step_times[m],
            "step_items": self.items[m],
            "traffic": _per_step(self.traffic[m]),
            "step_busy": None if any(c is None for c in self.comm_times[m]) else
            [w - c for w, c in zip(self.step_times[m], self.comm_times[m], strict=True)],
            "place": _place(),
            "startup": startup.rank_marks(self._first_step),
        }
        mine["busy_s"] = None if mine["comm_s"] is None else mine["wall_s"] - mine["comm_s"]
        ranks = collectives.all_gather(mine) if group.is_initialized() else [mine]
        slowest = max(r["wall_s"] for r in ranks)
        measured = all(r["comm_s"] is not None for r in ranks)
        busy = [r["busy_s"] for r in ranks] if measured else []
        # the job's step time at step t is its slowest rank's
        per_step = [max(ts) for ts in zip(*(r["step_times"] for r in ranks), strict=False)]
        return {
            "unit": self.unit,
            "world_size": len(ranks),
            "steps": min(r["steps"] for r in ranks),
            "warmup_steps": self.warmup_steps,
            "items": sum(r["items"] for r in ranks),
            "wall_s": slowest,
            "throughput": sum(r["items"] for r in ranks) / slowest if slowest > 0 else 0.0,
            "step_time_s": {
                "median": statistics.median(per_step) if per_step else 0.0,
                "min": min(per_step, default=0.0),
                "max": max(per_step, default=0.0),
            },
            "comm_share": statistics.fmean(r["comm_s"] / r["wall_s"] if r["wall_s"] > 0 else 0.0 for r in ranks)
            if measured else None,
            "imbalance": (max(busy) / min(busy) if min(busy) > 0 else 1.0) if measured else None,
            "per_rank": [{k: r[k] for k in ("wall_s", "cpu_s", "comm_s", "busy_s", "items", "steps")} for r in ranks],
            "traffic": _busiest(r["traffic"] for r in ranks),
            "quarters": _quarters(per_step, [sum(s) for s in zip(*(r["step_items"] for r in ranks), strict=False)]),
            # a rank persistently slower than the others: which, by how much, since which step (None: not measured)
            "stragglers": stragglers.find([r["step_busy"] for r in ranks], first_step=self.first_step + m.start,
                                          nodes=[r["place"][0] for r in ranks], hosts=[r["place"][1] for r in ranks])
            if len(ranks) > 1 else [],
            "startup": startup.job_startup([r["startup"] for r in ranks]),
        }

    def close(self, extra: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Stop the bar, reduce, and have rank 0 write ``summary.json`` (with ``extra``, or what ``extra(summary)``
        returns: figures derived from the reduced ones). Call on all ranks."""
        self._progress.stop()
        if self._profiler is not None:
            self._profiler.stop()
        if self._sampler is not None:
            self._sampler.stop()
        result = self.summary()
        if group.rank() == 0:
            for straggler in result["stragglers"] or []:  # named at a log point already, or only now
                self._say(straggler)
        if callable(extra):
            extra = extra(result)
        if extra:
            result.update(extra)
        if group.rank() == 0 and self.run_dir is not None:
            from multigpu.runtime.context import read_restarts

            deaths = read_restarts(self.run_dir)  # ranks that died and made the agent restart the group
            if deaths:
                result["restarts"] = deaths
            from multigpu.runtime.context import read_resizes

            resizes = read_resizes(self.run_dir)  # resumes at another world size: from, to, step, the check
            if resizes:
                result["resizes"] = resizes
            write_json_atomic(self.run_dir / "summary.json", result)
        return result
