"""Training metrics: reduced across ranks at log points, then written by rank 0 (inside each rank).

Every step adds its loss to a running sum on the device (no sync). At a log
point one small all-reduce (sum) and one (max) combine the window of every
rank: mean loss, tokens/s (all ranks' items over the slowest rank's time),
step time and the share of it spent in gradient communication. Rank 0 then
prints a line, appends it to ``metrics.jsonl`` in the run directory and hands
it to the trackers the ``logger`` key names (TensorBoard, W&B: see
:mod:`multigpu.train.trackers`); they get the run's summary when it closes.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import multigpu as mg
from multigpu.files import JsonlLog
from multigpu.monitor import StepMeter
from multigpu.monitor.meters import comm_share, drop_records_after, sum_comm
from multigpu.train.trackers import close_all

__all__ = ["MetricLogger"]


class MetricLogger:
    """Accumulates per-step figures and logs the reduced window; see the module docstring."""

    def __init__(self, run_dir: Path | None, meter: StepMeter, total_steps: int, *, fresh: bool = True,
                 resumed_at: int = 0, trackers: Callable[[], list] | None = None):
        self.run_dir = run_dir
        self.meter = meter
        self.total_steps = total_steps
        self._loss = None
        self._steps = 0
        self._mark = 0  # meter index at the previous log point
        self.first_step_at: float | None = None
        self.start = time.time()
        self.history: list[dict[str, Any]] = []
        self._trackers = trackers() if trackers is not None and mg.is_main() else []  # rank 0 only
        self._log = JsonlLog(run_dir / "metrics.jsonl", "metrics records") if run_dir is not None else None
        if fresh and run_dir is not None and mg.is_main():  # a new run in an old folder starts a new log
            (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        elif run_dir is not None and mg.is_main():
            drop_records_after(run_dir / "metrics.jsonl", resumed_at)

    def log(self, step: int, metrics: dict[str, Any], *, flush: bool) -> dict[str, Any] | None:
        """Add this step's figures; at ``flush`` reduce the window and have rank 0 write. Call on all ranks."""
        if self.first_step_at is None:
            self.first_step_at = time.time()
        loss = metrics["loss"].detach().double()
        self._loss = loss if self._loss is None else self._loss + loss
        self._steps += 1
        if not flush:
            return None
        record = self._reduce(step, metrics)
        if mg.is_main():
            self._write(record)
        return record

    def _reduce(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        m = self.meter
        m.flush()  # the step just ended too (on CUDA its figures are read one step later): a log point syncs anyway
        window = slice(self._mark, len(m.step_times))
        # step times end on the device (StepMeter reads each step's CUDA events); comm not measured
        # (DDP's NCCL all-reduce, FSDP's collectives) is NaN here, and None in the record: never a share of 0
        wall, comm, items = sum(m.step_times[window]), sum_comm(m.comm_times[window]), sum(m.items[window])
        summed = torch.tensor([self._loss.item(), self._steps, wall, comm, items], dtype=torch.float64)
        mg.all_reduce(summed, "sum", check_shapes=False)
        slowest = mg.all_reduce(torch.tensor([wall], dtype=torch.float64), "max", check_shapes=False).item()
        ws = mg.world_size()
        record = {
            "step": step,
            "loss": summed[0].item() / summed[1].item(),
            **({"val_loss": float(metrics["val_loss"])} if "val_loss" in metrics else {}),
            "grad_norm": float(metrics["grad_norm"]),
            "lr": float(metrics["lr"]),
            f"{m.unit}_per_s": summed[4].item() / slowest if slowest > 0 else None,
            "step_time_s": slowest / max(len(m.step_times) - self._mark, 1),
            "comm_share": comm_share(summed[3].item(), summed[2].item()),
            "elapsed_s": time.time() - self.start,
            "world_size": ws,
        }
        self._loss, self._steps, self._mark = None, 0, len(m.step_times)
        m.extras["loss"] = record["loss"]
        return record

    def _write(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        rate = record.get(f"{self.meter.unit}_per_s")
        parts = [f"step {record['step']}/{self.total_steps}", f"loss {record['loss']:.4f}"]
        if "val_loss" in record:
            parts.append(f"val_loss {record['val_loss']:.4f}")
        parts += [f"grad_norm {record['grad_norm']:.3f}", f"lr {record['lr']:.3g}"]
        if rate:
            parts.append(f"{rate:,.0f} {self.meter.unit}/s")
        share = record["comm_share"]
        parts.append(f"comm {100 * share:.0f}%" if share is not None else "comm n/a (not measured)")
        print(" | ".join(parts), flush=True)
        if self._log is not None:
            self._log.append(record)  # a whole line or none; a full disk is said once and the run goes on
        for tracker in self._trackers:
            tracker.log(record, self.meter.unit)

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """Around the training loop: an exception (or Ctrl-C) closes the trackers as failed, then goes on."""
        try:
            yield
        except BaseException as exc:
            self.close(exit_code=130 if isinstance(exc, KeyboardInterrupt) else 1)
            raise

    def close(self, summary: dict[str, Any] | None = None, *, exit_code: int = 0) -> None:
        """Close the trackers (with the run's summary); closing again does nothing."""
        trackers, self._trackers = self._trackers, []
        close_all(trackers, summary, exit_code)
