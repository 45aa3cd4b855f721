"""Shared parts of the GPU benchmarks: the machine's facts, peak FLOPS (``multigpu.train.mfu``'s table), timing, one JSON record per script.

Each script in this folder runs our code and its peer in the same run, prints
the ratio and, with ``--json PATH``, writes one record::

    {"benchmark": "train_mfu", "machine": {...}, "config": {...}, "ours": {...}, "peer": {...},
     "ratio": 1.04, "targets": {"mfu >= 0.45": true, "ratio >= 1.0": true}}

``--quick`` shrinks every size so the script runs on a CPU in seconds (tests/unit/test_gpu_benchmarks.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

STARTUP_S = 6.0
"""A fresh Python process importing torch and starting CUDA on the GPU machine (estimates for run_all.sh's caps;
the first GPU call, one H200 on 2026-11-27: the whole smoke step, start included, took 11 s)."""
COMPILE_COLD_S = 30.0
"""A cold ``torch.compile`` of GPT-2 small's forward and backward (the inductor cache empty): 20.8 s to the first
step on that H200, rounded up."""
COMPILE_WARM_S = 10.0
"""The same graph compiled again in another process, inductor's on-disk caches answering most of it: 3.2 s there."""
H100_BF16_FLOPS = 989e12
ASSUMED_MFU = 0.30
"""What the estimates assume a training step reaches (the target is 0.45: an estimate must not count on it)."""


def process_age_s() -> float:
    """Seconds since this process started (Linux: /proc/self/stat's start time against the uptime; 0 elsewhere):
    a step's budget counts from the process's start, its imports included."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def add_estimate_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--estimate", action="store_true",
                   help="print this script's estimated seconds on one H100 with these arguments (run_all.sh's "
                        "rehearsal checks it against the step's cap), and exit")


def print_estimate(parts: dict[str, float]) -> int:
    """``ESTIMATE <seconds>`` and the parts it adds up (the line run_all.sh's rehearsal reads)."""
    total = sum(parts.values())
    print(f"ESTIMATE {total:.0f} " + json.dumps({k: round(v, 1) for k, v in parts.items()}), flush=True)
    return 0


def peak_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU from its exact name (the package's table), or None when it is not there."""
    from multigpu.train.mfu import peak_tflops_for

    tflops = peak_tflops_for(device_name, "bf16", tf32=False)
    return tflops * 1e12 if tflops else None


def source_text() -> str:
    """The source this call runs (``benchmarks/gpu/source.py``'s ``text``, which run_all.sh passes on)."""
    try:
        return json.loads(os.environ["GPU_RUN_SOURCE"])["text"]
    except (KeyError, ValueError, TypeError):
        return "unknown: not run through run_all.sh (GPU_RUN_SOURCE unset)"


def machine() -> dict[str, Any]:
    """What the figures were measured on: GPU, driver, torch, CUDA, cores, and the source (commit)."""
    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
                            "cpu_cores": os.cpu_count(), "host": platform.node(), "commit": source_text()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_count=torch.cuda.device_count(), gpu_memory_gib=props.total_memory / 2**30,
                    sm_count=props.multi_processor_count)
        try:
            import pynvml

            pynvml.nvmlInit()
            driver = pynvml.nvmlSystemGetDriverVersion()
            info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
            pynvml.nvmlShutdown()
        except Exception as exc:  # noqa: BLE001 - no NVML: the figure is simply missing
            info["driver"] = f"unknown ({type(exc).__name__})"
    else:
        info["gpu"] = None
    return info


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags every script takes: --quick, --device, --json."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    p.add_argument("--quick", action="store_true", help="tiny sizes: seconds on a CPU (the smoke test)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="default: cuda if available")
    p.add_argument("--json", metavar="PATH", help="write the record here")
    return p


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device; valid here: auto, cpu", file=sys.stderr)
        raise SystemExit(2)
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(choice, 0) if choice == "cuda" else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[Any, float]:
    """(fn(), seconds), with the device synchronized before and after."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def peak_memory_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def write_record(path: str | None, record: dict[str, Any], *, quiet: bool = False) -> None:
    """Print the record (unless ``quiet``: a partial one, rewritten as the script goes) and write it to ``path``
    (atomically) when given. Every record carries ``machine`` (the GPU, and which torch ran)."""
    text = json.dumps(record, indent=2, default=str)
    if not quiet:
        print("RECORD " + json.dumps(record, default=str), flush=True)
    if path:
        from multigpu.files import write_text_atomic

        write_text_atomic(Path(path), text + "\n")


def child_result(stdout: str) -> dict[str, Any] | None:
    """The ``RESULT {...}`` line a child process printed, parsed (None when it printed none)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return None


def sampler_summary(path: Path) -> dict[str, Any]:
    """GPU 0's utilization, memory and power over a sampler file (``multigpu.monitor.Sampler``)."""
    if not path.exists():
        return {"samples": 0}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    gpu = [r["gpus"][0] for r in records if r.get("gpus")]
    util = [g["util_percent"] for g in gpu if g.get("util_percent") is not None]
    mem = [g["memory_used_gib"] for g in gpu if g.get("memory_used_gib") is not None]
    power = [g["power_w"] for g in gpu if g.get("power_w") is not None]
    return {"samples": len(records), "gpu_samples": len(gpu),
            "gpu_util_mean": sum(util) / len(util) if util else None, "gpu_util_max": max(util, default=None),
            "gpu_memory_max_gib": max(mem, default=None), "gpu_power_max_w": max(power, default=None),
            "host_cpu_percent_max": max((r["cpu_percent"] for r in records if r.get("cpu_percent") is not None),
                                        default=None)}
