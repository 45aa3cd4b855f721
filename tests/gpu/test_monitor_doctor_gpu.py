"""The NVML sampler records a busy GPU's utilization and memory; `multigpu doctor` passes a GPU host."""

from __future__ import annotations

import json
import time

import pytest
import torch

from multigpu.monitor import Sampler
from multigpu.testing import requires_gpus
from tests.conftest import run_cli

pytestmark = pytest.mark.gpu


def gpu_figures(path) -> dict:
    """Per sample file: the GPUs seen, and the peak utilization and memory of GPU 0."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    gpus = [r["gpus"] for r in records if r["gpus"]]
    first = [g[0] for g in gpus]
    return {"samples": len(records), "with_gpus": len(gpus), "names": sorted({g["name"] for s in gpus for g in s}),
            "util_max": max((g["util_percent"] or 0 for g in first), default=0),
            "memory_max_gib": max((g["memory_used_gib"] or 0.0 for g in first), default=0.0),
            "memory_total_gib": max((g["memory_total_gib"] or 0.0 for g in first), default=0.0)}


@requires_gpus(1)
def test_nvml_sampler_records_utilization_and_memory_of_a_busy_gpu(tmp_path):
    pytest.importorskip("pynvml")
    block = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda:0")  # 2 GiB held during the samples
    a = torch.randn(4096, 4096, device="cuda:0")
    with Sampler(tmp_path, interval_s=0.2) as sampler:
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
    del block
    seen = gpu_figures(sampler.path)
    assert seen["samples"] >= 5 and seen["with_gpus"] == seen["samples"], seen
    assert torch.cuda.get_device_name(0) in seen["names"], seen
    assert seen["util_max"] > 50 and seen["memory_max_gib"] >= 2.0 and seen["memory_total_gib"] > 10, seen


@requires_gpus(1)
def test_doctor_passes_a_gpu_host():
    proc = run_cli("doctor", "--json", timeout=240)
    report = json.loads(proc.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    facts = report["facts"]
    assert len(facts["gpus"]) == torch.cuda.device_count() and facts["cuda_build"]
    for name in ("torch", "GPUs", "NCCL", "gloo"):
        assert checks[name]["status"] == "pass", checks[name]
    assert checks["driver / NVML"]["status"] == "pass" and facts["nvml_driver"], checks["driver / NVML"]
    bandwidth = facts["bandwidth"]
    assert bandwidth is not None and bandwidth["busbw_gbps"] > 0, facts.get("bandwidth_error")
    assert bandwidth["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo")
