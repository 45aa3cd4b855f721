"""The device sampler and the step profiler, in one process (no process group needed)."""

from __future__ import annotations

import json
import os
import time
from types import SimpleNamespace

import pytest
import torch

from multigpu.argtypes import parse_window
from multigpu.errors import ConfigError
from multigpu.launch.config import LaunchConfig
from multigpu.monitor import Sampler, StepMeter
from multigpu.monitor.sampler import gpu_samples, register_rank, start_for_rank
from multigpu.runtime.context import RunContext


def test_sampler_writes_host_and_rank_lines_from_a_thread_until_stopped(tmp_path):
    register_rank(tmp_path)
    with Sampler(tmp_path, interval_s=0.05, gpus=False) as sampler:
        deadline = time.time() + 0.5
        while time.time() < deadline:
            sum(i * i for i in range(20000))  # some CPU for this rank to show
    lines = [json.loads(x) for x in sampler.path.read_text().splitlines()]
    assert sampler.path.name == "samples_node0.jsonl" and len(lines) >= 4
    assert [s["time"] for s in lines] == sorted(s["time"] for s in lines)
    first, last = lines[0], lines[-1]
    assert first["cpu_percent"] is None and first["ranks"][0]["cpu_percent"] is None  # no interval measured yet
    assert last["ranks"][0]["pid"] == os.getpid() and last["ranks"][0]["rank"] == 0
    assert last["ranks"][0]["rss_gib"] > 0 and last["memory_total_gib"] > last["memory_used_gib"] > 0
    assert max(s["ranks"][0]["cpu_percent"] or 0 for s in lines) > 0 and last["gpus"] == []
    n = len(lines)
    time.sleep(0.2)
    assert len(sampler.path.read_text().splitlines()) == n  # stopped means stopped


def test_gpu_samples_convert_nvml_units_and_survive_unsupported_figures():
    class NotSupported(Exception):
        pass

    def no_power(handle):
        raise NotSupported

    nvml = SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=87 + h),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=2 * 2**30, total=80 * 2**30),
        nvmlDeviceGetPowerUsage=lambda h: 350_500 if h == 0 else no_power(h),
        nvmlDeviceGetName=lambda h: b"NVIDIA H100",
        nvmlDeviceGetTemperature=lambda h, sensor: 65,
    )
    a, b = gpu_samples(nvml, [0, 1])
    assert a == {"index": 0, "name": "NVIDIA H100", "util_percent": 87, "memory_used_gib": 2.0,
                 "memory_total_gib": 80.0, "power_w": 350.5, "temperature_c": 65}
    assert b["index"] == 1 and b["util_percent"] == 88 and b["power_w"] is None


def test_sampling_interval_zero_turns_it_off_and_a_bad_one_is_refused(tmp_path):
    assert start_for_rank(tmp_path, 0) is None and not (tmp_path / "ranks").exists()
    with pytest.raises(ConfigError, match="run.sample_interval_s=-1.0 is invalid"):
        RunContext(sample_interval_s=-1.0)
    with pytest.raises(ConfigError, match="--sample-interval-s -2.0 is invalid"):
        LaunchConfig(sample_interval_s=-2.0)


def test_a_plain_step_meter_starts_nothing(tmp_path):
    """The constructor is explicit: no sampler thread, no profiler unless given (or from_context)."""
    meter = StepMeter("items", run_dir=tmp_path, progress=False)
    with meter.step(items=1):
        pass
    meter.close()
    assert not (tmp_path / "samples_node0.jsonl").exists() and not (tmp_path / "profile").exists()


def test_profile_in_the_run_context_makes_the_meter_write_a_trace_for_its_window(tmp_path):
    run = RunContext(run_dir=str(tmp_path), profile=True, profile_steps=(1, 1, 2), sample_interval_s=0.1)
    meter = StepMeter.from_context("items", run, progress=False)
    for _ in range(5):
        with meter.step(items=4):
            torch.mm(torch.ones(64, 64), torch.ones(64, 64))
    summary = meter.close()
    trace = json.loads((tmp_path / "profile" / "rank0.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names and summary["steps"] == 4
    assert (tmp_path / "samples_node0.jsonl").is_file() and (tmp_path / "summary.json").is_file()
    assert parse_window("0,0,1") == (0, 0, 1)
    with pytest.raises(ConfigError, match="wait,warmup,active"):
        parse_window("3")
