"""Step and communication times on CUDA, on a CPU-only machine.

CUDA queues kernels and returns: a host clock around a step or a collective measures queueing. These tests
stand in a fake ``torch.cuda.Event`` whose ``synchronize`` takes the time the "GPU" still needs and whose
``elapsed_time`` reports device time, and check that the meter times each CUDA step by its events and reads
them one step later (never waiting for the step just queued, never synchronizing on the CPU), that CUDA collectives are timed by events, and that communication nobody can time
(DDP's NCCL all-reduce) is reported as not measured, shown as "—", never as 0.
"""

from __future__ import annotations

import io
import time
from unittest import mock

import pytest
import torch

from multigpu.runtime import calls, collectives, devicetime
from multigpu.runtime.group import DistEnv

GPU_TAIL_S = 0.08
"""How long the fake GPU still runs after the host has queued a step."""


class FakeEvents:
    """A stand-in for ``torch.cuda.Event``: a GPU clock that the test moves, and a log of what was asked."""

    def __init__(self) -> None:
        self.gpu_clock_s = 0.0
        self.made = 0
        self.synchronized = 0

    def __call__(self, enable_timing: bool = False):
        events = self
        events.made += 1

        class Event:
            def record(self, stream=None):
                self.at = events.gpu_clock_s

            def synchronize(self):
                events.synchronized += 1
                time.sleep(GPU_TAIL_S)  # the queued work runs to the end

            def query(self):
                return True

            def elapsed_time(self, other):
                return (other.at - self.at) * 1000.0

        return Event()


@pytest.fixture
def events():
    fake = FakeEvents()
    with mock.patch("torch.cuda.Event", fake), mock.patch("torch.cuda.current_stream", lambda device=None: None):
        yield fake


def _meter(device):
    from multigpu.monitor import StepMeter

    return StepMeter("items", progress=False, warmup_steps=0, device=device)


def test_meter_reads_each_cuda_step_one_step_later_with_the_same_figures(events):
    """A CUDA step is bracketed by two timing events and its time is the GPU's between them (what it queued,
    not only the time to queue it). The host never waits for the step it has just queued: at the end of step k
    it reads step k-1's events (the GPU is past them by then), so it queues step k+1 while the GPU runs step k.
    Before: every step waited on its own end event, and the GPU idled while the host queued the next step."""
    meter = _meter(torch.device("cuda", 0))
    for k in range(3):
        with meter.step(items=4):
            events.gpu_clock_s += GPU_TAIL_S  # the GPU runs the kernels the host queued (it returned at once)
        assert events.synchronized == k  # step k-1's end event only, never the step just queued
    assert meter.step_times == pytest.approx([GPU_TAIL_S] * 2)  # the third is read at the next step or close
    summary = meter.close()
    assert events.synchronized == 3 and meter.step_times == pytest.approx([GPU_TAIL_S] * 3)
    assert summary["throughput"] == pytest.approx(12 / (3 * GPU_TAIL_S))


def test_meter_on_this_ranks_device_by_default(events):
    with mock.patch("multigpu.runtime.group.current_device", lambda: torch.device("cuda", 3)):
        meter = _meter(None)
        with meter.step(items=1):
            pass
        meter.flush()
    assert events.made == 2 and events.synchronized == 1


def test_meter_never_synchronizes_on_the_cpu(events, monkeypatch):
    monkeypatch.setattr(f"{__name__}.GPU_TAIL_S", 30.0)  # a wait for the "GPU" would show as 30 s: no loaded host's
    meter = _meter(torch.device("cpu"))
    for _ in range(3):
        with meter.step(items=4):
            pass
    assert events.made == 0 and events.synchronized == 0
    assert max(meter.step_times) < 30.0


def _nccl_env():
    return DistEnv(rank=0, local_rank=0, world_size=2, local_world_size=2, node_rank=0,
                   device=torch.device("cuda", 0), backend="nccl")


def test_a_cuda_collective_is_timed_on_the_device_not_by_the_host_clock(events):
    """all_reduce of a CUDA tensor: the events around it say 0.5 s on the GPU; the host returned at once."""
    spans = devicetime.DeviceSpans()

    def all_reduce(tensor, op=None):
        # NCCL's kernels (and the wait for the peer) run on the device; an hour there for the CPU tensor's call, which
        # the host clock times: read from the events, it would show
        events.gpu_clock_s += 0.5 if tensor.device.type == "cuda" else 3600.0

    with mock.patch.object(calls, "_DEVICE_SPANS", spans), \
            mock.patch.object(collectives, "_active", lambda: True), \
            mock.patch("multigpu.runtime.group.get_env", lambda *a: _nccl_env()), \
            mock.patch("torch.distributed.all_reduce", all_reduce):
        before = collectives.collective_seconds()
        # a stand-in for a CUDA tensor of 4 float32 (its bytes are counted for bench --predict)
        cuda_tensor = mock.Mock(device=torch.device("cuda", 0), **{"numel.return_value": 4, "element_size.return_value": 4})
        collectives.all_reduce(cuda_tensor, check_shapes=False)
        device_s = collectives.collective_seconds() - before
        collectives.all_reduce(torch.ones(2), check_shapes=False)  # a CPU tensor (gloo beside NCCL): host clock
        host_s = collectives.collective_seconds() - before - device_s
    assert device_s == pytest.approx(0.5)
    assert 0 <= host_s < 60 and events.made == 2  # the CPU call made no event, and was not timed on the device


def test_a_span_still_running_is_counted_when_done_without_waiting(events):
    spans = devicetime.DeviceSpans()
    device = torch.device("cuda", 0)
    start = spans.begin(device)
    events.gpu_clock_s = 0.25
    spans.end(start, device)
    stop = spans._pending[0][-1]
    stop.query = lambda: False  # not run yet: not counted, and not waited for
    assert spans.seconds() == 0.0 and spans.pending() == 1 and events.synchronized == 0
    stop.query = lambda: True
    assert spans.seconds() == pytest.approx(0.25) and spans.pending() == 0


def test_ddp_on_nccl_reports_communication_as_not_measured():
    from multigpu.train import strategies

    with mock.patch.object(strategies, "DistributedDataParallel", lambda module, **kw: mock.Mock(process_group=None)):
        _, timer = strategies.wrap_ddp(torch.nn.Linear(2, 2), _nccl_env(), "auto")
    assert timer is not None and timer.pop_seconds() is None  # before: None, and the comm share read 0


def test_not_measured_comm_is_none_in_the_summary_never_zero():
    meter = _meter(torch.device("cpu"))
    for _ in range(3):
        with meter.step(items=4):
            meter.add_comm(None)
    s = meter.close()
    assert s["comm_share"] is None and s["imbalance"] is None
    assert s["per_rank"][0]["comm_s"] is None and s["per_rank"][0]["busy_s"] is None
    assert s["throughput"] > 0


def test_not_measured_shows_as_a_dash_in_the_bench_table_and_report():
    from multigpu.bench.table import scaling_rows
    from multigpu.cli.bench import print_table

    def summary(n, share, imbalance, busy):
        return {"world_size": n, "summary": {
            "world_size": n, "throughput": 100.0 * n, "step_time_s": {"median": 0.01},
            "comm_share": share, "imbalance": imbalance, "per_rank": [{"busy_s": busy, "items": 10}] * n}}

    rows = scaling_rows([summary(1, 0.0, 1.0, 1.0), summary(2, None, None, None)])
    assert rows[1]["comm_share"] is None and rows[1]["imbalance"] is None and rows[1]["compute_per_item_s"] is None
    from rich.console import Console

    out = io.StringIO()
    print_table({"unit": "items", "rows": rows}, out=Console(file=out, width=200))
    two = next(line for line in out.getvalue().splitlines() if line.strip().lstrip("│┃| ").startswith("2 "))
    cells = [c.strip() for c in two.strip("│ ").split("│")]
    assert cells[-2:] == ["—", "—"]  # comm share, imbalance: not measured, not "0%" and "1.00"


def test_training_log_line_says_comm_not_measured(capsys, single_rank_group):
    from multigpu.train.trackers import console_line

    meter = _meter(torch.device("cpu"))
    records = []
    meter.on_record.append(lambda record: records.append(record) or print(console_line(record, 2, meter.unit)))
    for step in (1, 2):
        with meter.step(items=8):
            meter.add_comm(None)
            meter.add(loss=torch.tensor(1.0))
            meter.extras.update(grad_norm=1.0, lr=0.1)
            if step == 2:
                meter.point()  # the trainer's last step
    [record] = records
    assert record["comm_share"] is None and record["step"] == 2
    assert "comm n/a" in capsys.readouterr().out


def test_a_cuda_runs_start_up_ends_with_its_first_steps_time_on_the_gpu(events):
    """Where start-up ends (``startup`` in the summary): the first step's wall-clock start plus its time on the
    GPU, known once its events are read (a step later); not the host's time to queue it."""
    meter = _meter(torch.device("cuda", 0))
    before = time.time()
    for _ in range(2):
        with meter.step(items=4):
            events.gpu_clock_s += 10.0  # ten "GPU" seconds, queued at once
    assert meter._first_step is not None
    start, end = meter._first_step
    assert before <= start <= time.time() and end - start == pytest.approx(10.0)
