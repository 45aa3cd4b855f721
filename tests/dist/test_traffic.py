"""The job's own collectives counted on real gloo ranks: what ``bench --predict`` extrapolates."""

from __future__ import annotations

import pytest
import torch

import multigpu as mg
from multigpu.monitor import StepMeter
from multigpu.runtime import collectives
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist


def _known_pattern() -> dict:
    before = collectives.traffic()
    mg.all_reduce(torch.ones(1000), check_shapes=False)  # 4,000 bytes
    mg.all_reduce(torch.ones(10, dtype=torch.float64))  # 80 bytes, after an 80-byte shape check (all-gather)
    mg.all_gather(torch.ones(3 + mg.rank(), 5))  # rank 1's 4 x 5 floats: rank 0 pads to the same 80 bytes
    if mg.rank() == 0:
        collectives.send(torch.ones(256, dtype=torch.uint8), 1)  # 256 bytes after an 80-byte header
    else:
        collectives.recv(0)
    after = collectives.traffic()
    return {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1]) for k, v in after.items()
            if v != before.get(k)}


def test_counts_calls_and_bytes_of_a_known_pattern():
    zero, one = run_on_ranks(_known_pattern, 2, timeout_s=90)
    assert zero["all_reduce"] == one["all_reduce"] == (2, 4000 + 80)
    # shape checks of the second all-reduce and of the all-gather, then the all-gather itself (padded rows)
    assert zero["all_gather"] == one["all_gather"] == (3, 80 + 80 + 4 * 5 * 4)
    assert zero["p2p"] == (2, 80 + 256) and "p2p" not in one  # only the sender counts


def _ddp_steps() -> dict:
    from multigpu.train.strategies import wrap_ddp

    torch.manual_seed(0)
    model = torch.nn.Linear(100, 10)  # 1,010 float32 parameters: 4,040 gradient bytes, one bucket
    ddp, timer = wrap_ddp(model, mg.init(), "auto")
    meter = StepMeter("samples", warmup_steps=1, progress=False)
    for _ in range(4):
        with meter.step(items=8):
            ddp(torch.randn(8, 100)).sum().backward()
            meter.add_comm(timer.pop_seconds())
    return meter.close()


def test_step_meter_reports_ddp_gradient_bytes_per_step():
    summary, _ = run_on_ranks(_ddp_steps, 2, timeout_s=90)
    assert summary["traffic"]["all_reduce"] == {"calls": 1.0, "bytes": 4040.0}
