"""On a real GPU: step times include the queued kernels (read one step later, with no wait at the step's end), the
MFU table knows this board, the sampler finds this rank's GPU by UUID. The CPU tier proves the same logic with fakes (tests/fakecuda/test_monitor_cuda.py,
test_mfu_peaks.py, test_sampler_gpus.py); these check the facts the fakes stand in for."""

from __future__ import annotations

import time

import pytest
import torch

from multigpu.monitor import StepMeter
from multigpu.testing import requires_gpus

pytestmark = pytest.mark.gpu


def _queue_work(a: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        a = (a @ a).clamp_(-1, 1)
    return a


@requires_gpus(1)
def test_a_cuda_step_is_timed_to_the_end_of_its_kernels():
    device = torch.device("cuda", 0)
    a = torch.randn(8192, 8192, device=device)
    _queue_work(a, 2)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    _queue_work(a, 40)
    queued_s = time.perf_counter() - t0  # the host's time to queue: what the meter measured before
    end.record()
    end.synchronize()
    gpu_s = start.elapsed_time(end) / 1000
    assert gpu_s > 5 * queued_s, (gpu_s, queued_s)  # the premise: the host runs far ahead of the GPU

    meter = StepMeter("items", progress=False, warmup_steps=0, device=device)
    with meter.step(items=1):
        _queue_work(a, 40)
    # the host did not wait at the step's end: the GPU still runs its kernels (the events are read a step later)
    assert not torch.cuda.current_stream(device).query()
    meter.flush()
    assert meter.step_times[0] >= 0.9 * gpu_s, (meter.step_times[0], gpu_s)


@requires_gpus(1)
def test_this_board_has_an_mfu_peak():
    from multigpu.train.mfu import PEAK_TFLOPS, peak_flops

    name = torch.cuda.get_device_name(0)
    if not any(key in name for key in ("H100", "H200", "A100", "GH200")):
        pytest.skip(f"{name}: not a board this suite expects to know")
    assert name in PEAK_TFLOPS, f"{name!r} is not in the peak table under its exact name"
    assert peak_flops(torch.device("cuda", 0), "bf16") is not None


@requires_gpus(1)
def test_the_ranks_uuid_is_nvmls_name_for_its_gpu(monkeypatch):
    pynvml = pytest.importorskip("pynvml")
    from multigpu.monitor.sampler import rank_gpu_uuid

    monkeypatch.setattr("multigpu.runtime.group.current_device", lambda: torch.device("cuda", 0))
    uuid = rank_gpu_uuid()
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        assert pynvml.nvmlDeviceGetUUID(handle) in (uuid, uuid.encode())
    finally:
        pynvml.nvmlShutdown()
