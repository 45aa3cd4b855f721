"""Log points: a step meter's figures since the last one, reduced across ranks into one record (inside each rank).

Every workload's records come from here, at one cadence: a log point after every ``log_every``-th step as the run
counts them (a resumed run's too: its steps are numbered from the checkpoint's, so its log points fall on the
steps an uninterrupted run's do), and after a step the workload marks (:meth:`MetricsLog.point`: train's steps
with a validation loss, its last step). A :class:`~multigpu.run.Run` ends its steps itself (the log point
comes after the workload's whole step, before the callbacks); a meter used alone ends each step as it is timed.

At a log point every rank reduces the window (one all-reduce for the slowest rank's time, one for the sums), rank 0
appends the record to ``metrics.jsonl`` in the run directory, and every rank hands it to the workload's hooks
(:attr:`MetricsLog.on_record`: train prints its line and feeds its trackers on rank 0, and checks for a non-finite
step on every rank). A record holds::

    step            the step it ends (as the run counts them)
    <figures>       the workload's: the mean of each added figure over the window's steps and ranks (a loss),
                    a marked step's figures (a validation loss), the latest of each extra (grad_norm, lr, S, I, R)
    <unit>_per_s    items of every rank / the slowest rank's time, over the window
    step_time_s     the slowest rank's time per step
    comm_share      communication / step time (None: not measured)
    steps           steps in the window
    elapsed_s       seconds since the meter was made
    world_size      ranks
    time            when it was written (Unix seconds)

A resumed run repeats the steps after its checkpoint, so the records of those steps (a killed or stopped attempt's)
are dropped as the first record is written (:func:`drop_records_after`): each step is in ``metrics.jsonl`` once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from multigpu.files import JsonlLog, read_jsonl, write_text_atomic
from multigpu.runtime import collectives, group

__all__ = ["MetricsLog", "comm_share", "drop_records_after", "sum_comm"]


def sum_comm(comm_times: list[float | None]) -> float:
    """The total of per-step comm times; NaN when any step's was not measured (None)."""
    return float("nan") if any(c is None for c in comm_times) else float(sum(comm_times))


def comm_share(comm_s: float, wall_s: float) -> float | None:
    """comm / wall; None when comm was not measured (NaN)."""
    if comm_s != comm_s:
        return None
    return comm_s / wall_s if wall_s > 0 else 0.0


def drop_records_after(path: Path, step: int) -> None:
    """Rank 0, as a run starts logging: a resumed run repeats the steps after its checkpoint (``step``; 0 for a run
    that starts from the beginning), so the records of those steps (a killed or stopped attempt's) go, and a torn
    last line (a writer killed mid-line). Each step is then in ``metrics.jsonl`` once."""
    if not path.is_file():
        return
    records = read_jsonl(path)
    kept = [r for r in records if r.get("step", 0) <= step]
    if len(kept) != len(path.read_text(errors="replace").splitlines()):
        write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def _number(value: Any) -> Any:
    """A figure as the record holds it: a tensor read (at a log point only), anything else as it is."""
    return float(value) if isinstance(value, torch.Tensor) else value


class MetricsLog:
    """A :class:`~multigpu.monitor.StepMeter`'s log points; see the module docstring. The meter makes it."""

    def __init__(self, meter: Any, log_every: int):  # its StepMeter (which imports this module)
        self.meter = meter
        self.log_every = log_every
        self.on_record: list[Callable[[dict[str, Any]], None]] = []
        """Called on every rank with each record, once rank 0 has written it (train: its console line and trackers
        on rank 0, its non-finite check on every rank)."""
        self.shown: dict[str, float] = {}
        """The means of the last record (a loss), shown on the progress bar until the next."""
        self._sums: dict[str, Any] = {}
        self._counts: dict[str, int] = {}
        self._point: dict[str, Any] | None = None
        self._logged = 0  # the meter's steps at the previous log point
        self._started = time.time()
        self._file: JsonlLog | None = None

    # ------------------------------------------------------------------ what the workload gives
    def add(self, **figures: Any) -> None:
        """This step's ``figures`` whose mean the next record holds (a loss): summed over the steps since the last
        log point and over the ranks, then divided by their count. A tensor is summed where it is (no sync)."""
        for name, value in figures.items():
            value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
            self._sums[name] = value if name not in self._sums else self._sums[name] + value
            self._counts[name] = self._counts.get(name, 0) + 1

    def point(self, **figures: Any) -> None:
        """Make the step in progress a log point, its record holding ``figures`` too (train's validation loss)."""
        self._point = {**(self._point or {}), **figures}

    # ------------------------------------------------------------------ the cadence
    def due(self, step: int) -> bool:
        """Whether step ``step`` (as the run counts them) ends with a log point."""
        return self._point is not None or (self.log_every > 0 and step % self.log_every == 0)

    def end_step(self, step: int) -> dict[str, Any] | None:
        """After step ``step``: its log point, when one is due. Call on all ranks. Returns the record (every rank's
        figures are the job's), or None."""
        if not self.due(step):
            return None
        return self._reduce(step)

    # ------------------------------------------------------------------ a log point
    def _reduce(self, step: int) -> dict[str, Any] | None:
        m = self.meter
        m.flush()  # every step up to here recorded (on CUDA: the GPU has run them; a log point syncs anyway)
        first, point, self._point = self._logged, self._point or {}, None
        steps = m.steps - first
        if steps <= 0:  # no step timed since the last log point
            return None
        self._logged = m.steps
        names = sorted(self._sums)
        sums = [float(self._sums[n]) for n in names]  # one host read per figure, at log points only
        counts = [float(self._counts[n]) for n in names]
        self._sums, self._counts = {}, {}
        wall, items = sum(m.step_times[first:]), float(sum(m.items[first:]))
        comm = sum_comm(m.comm_times[first:])  # not measured travels as NaN: any rank's NaN makes the job's NaN
        summed = collectives.all_reduce(torch.tensor([wall, comm, items, *sums, *counts], dtype=torch.float64),
                                        "sum", check_shapes=False).tolist()
        slowest = collectives.all_reduce(torch.tensor([wall], dtype=torch.float64), "max", check_shapes=False).item()
        means = {n: summed[3 + i] / summed[3 + len(names) + i] for i, n in enumerate(names)}
        record: dict[str, Any] = {"step": step, **means, **{k: _number(v) for k, v in point.items()}}
        for name, value in m.extras.items():
            record.setdefault(name, _number(value))
        record.update({
            f"{m.unit}_per_s": summed[2] / slowest if slowest > 0 else None,
            "step_time_s": slowest / steps,
            "comm_share": comm_share(summed[1], summed[0]),
            "steps": steps,
            "elapsed_s": time.time() - self._started,
            "world_size": group.world_size() if group.is_initialized() else 1,
            "time": time.time(),
        })
        self.shown = means
        if group.rank() == 0 and m.run_dir is not None:
            self._write(m.run_dir / "metrics.jsonl", record)
        for hook in self.on_record:
            hook(record)
        m.watch_stragglers()  # a rank that stays slower than the others is named as it happens (a collective)
        return record

    def _write(self, path: Path, record: dict[str, Any]) -> None:
        if self._file is None:
            drop_records_after(path, self.meter.first_step - 1)  # a resumed run's later steps: the run it continues
            self._file = JsonlLog(path, "metrics records")
        self._file.append(record)  # a whole line or none; a full disk is said once and the run goes on
