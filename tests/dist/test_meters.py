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


def _imbalanced_steps(run_dir: str) -> dict:
    meter = StepMeter("items", run_dir=run_dir, log_every=2, warmup_steps=1, progress=False)
    for _ in range(5):
        with meter.step(items=10):
            if mg.rank() == 0:
                time.sleep(0.02)
            else:  # rank 1 computes 4x longer, on the CPU
                end = time.perf_counter() + 0.08
                while time.perf_counter() < end:
                    pass
            mg.all_reduce(torch.ones(1), check_shapes=False)  # rank 0 waits here for rank 1
    return meter.close(extra={"note": "test"})


def test_meter_reduces_across_ranks_and_measures_imbalance(tmp_path):
    a, b = run_on_ranks(_imbalanced_steps, 2, args=(str(tmp_path),), timeout_s=90)
    assert a["world_size"] == 2 and a["steps"] == 4 and a["items"] == 80  # warm-up step left out
    assert a["throughput"] == pytest.approx(80 / a["wall_s"])
    assert 2.5 < a["imbalance"] < 6  # busy 0.08 vs 0.02 per step
    assert a["per_rank"][0]["comm_s"] > a["per_rank"][1]["comm_s"]  # rank 0 waited on rank 1
    assert a["comm_share"] > 0.2
    # CPU seconds per rank: rank 0 slept, rank 1 spun (at most its wall time, however loaded the machine)
    cpu0, cpu1 = a["per_rank"][0]["cpu_s"], a["per_rank"][1]["cpu_s"]
    assert cpu0 < 0.5 * cpu1 and 0 < cpu1 <= a["per_rank"][1]["wall_s"] + 0.05
    assert a["imbalance"] == b["imbalance"]  # every rank gets the same reduced figures
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["note"] == "test" and written["items"] == 80
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 4]  # only rank 0 wrote, at each log point
    assert all(x["items_per_s"] > 0 for x in lines)
