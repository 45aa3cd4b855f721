"""StepMeter on real ranks: reduced figures, imbalance and communication measured, rank 0 writes."""

from __future__ import annotations

import json
import time

import pytest
import torch

import multigpu as mg
from multigpu.monitor import StepMeter
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist


class _SharedClock:
    """A virtual clock per rank, put in place of ``time.perf_counter`` and ``time.process_time``: a rank's work moves
    its own clock; a collective ends on every rank at the latest rank's clock, as a blocking collective does (an
    all-reduce "max" of the clocks, in place: the meter reads the tensor the collective is filling). The figures
    are then exact, however loaded the machine."""

    def __init__(self):
        self.wall = torch.zeros(1, dtype=torch.float64)
        self.cpu = 0.0

    def install(self) -> None:
        time.perf_counter = lambda: float(self.wall[0])
        time.process_time = lambda: self.cpu

    def sleep(self, seconds: float) -> None:
        self.wall += seconds

    def compute(self, seconds: float) -> None:
        self.wall += seconds
        self.cpu += seconds

    def meet(self) -> None:
        """The step's collective: this rank waits there until the last rank arrives."""
        mg.all_reduce(self.wall, "max", check_shapes=False)


def _imbalanced_steps(run_dir: str) -> dict:
    clock = _SharedClock()
    clock.install()  # this rank's process only (a spawned child)
    meter = StepMeter("items", run_dir=run_dir, log_every=2, warmup_steps=1, progress=False)
    for _ in range(5):
        with meter.step(items=10):
            if mg.rank() == 0:
                clock.sleep(0.02)
            else:  # rank 1 computes 4x longer, on the CPU
                clock.compute(0.08)
            clock.meet()  # rank 0 waits here for rank 1
    return meter.close(extra={"note": "test"})


def test_meter_reduces_across_ranks_and_measures_imbalance(tmp_path):
    """Each step rank 0 sleeps 20 ms, rank 1 computes 80 ms, then both meet in an all-reduce: rank 0 waited 60 ms
    there. On virtual clocks (the meter's and the collectives' own): a 20 ms sleep against an 80 ms spin on a
    loaded machine gave any ratio."""
    a, b = run_on_ranks(_imbalanced_steps, 2, args=(str(tmp_path),), timeout_s=90)
    assert a["world_size"] == 2 and a["steps"] == 4 and a["items"] == 80  # warm-up step left out
    assert a["wall_s"] == pytest.approx(0.32) and a["throughput"] == pytest.approx(80 / 0.32)
    assert a["imbalance"] == pytest.approx(4.0)  # busy 0.08 vs 0.02 per step
    r0, r1 = a["per_rank"]
    assert r0["comm_s"] == pytest.approx(4 * 0.06) and r1["comm_s"] == pytest.approx(0.0)  # rank 0 waited on rank 1
    assert r0["busy_s"] == pytest.approx(4 * 0.02) and r1["busy_s"] == pytest.approx(4 * 0.08)
    assert a["comm_share"] == pytest.approx((0.06 / 0.08 + 0) / 2)
    assert r0["cpu_s"] == pytest.approx(0.0) and r1["cpu_s"] == pytest.approx(4 * 0.08)  # rank 0 slept, rank 1 computed
    assert a["step_time_s"]["median"] == pytest.approx(0.08)
    assert a["imbalance"] == b["imbalance"] and a["per_rank"] == b["per_rank"]  # every rank gets the same figures
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["note"] == "test" and written["items"] == 80
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4]  # only rank 0 wrote, at each log point
    assert [x["items_per_s"] for x in lines] == pytest.approx([250.0, 250.0])  # 2 x 10 items per 0.08 s step


def test_a_steps_cpu_seconds_are_this_process_cpu_time():
    """What the virtual clocks above stand in for: a step that computes counts the CPU it used, a step that sleeps
    none of it (CPU time, not wall time: the same on a loaded machine)."""
    meter = StepMeter("items", warmup_steps=0, progress=False)
    with meter.step():
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
    with meter.step():
        time.sleep(0.05)
    computed, slept = meter.cpu_times
    assert computed >= 0.05 and slept < 0.5 * computed
