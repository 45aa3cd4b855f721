"""``--dry-run --world-size N``: the job as rank r of N, checked and measured in this one process (launcher side).

    multigpu train -f nano --dry-run --world-size 64 --device-memory H100
    multigpu train --strategy fsdp --dry-run --world-size 1024 --dry-run-rank 1023 --device-memory 40GB
    multigpu sim --agents 1_000_000_000 --dry-run --world-size 1024 --device-memory A100
    multigpu infer --input big.tif --dry-run --world-size 64

Nothing is spawned and nothing is written. The workload's own ``check`` runs against a plan of N ranks
(GPUs, 8 per node unless ``--nproc-per-node`` says otherwise; ``--cpu``: CPU ranks); then the workload's
part (its ``Workload.dry_run``: :mod:`multigpu.train.dryrun`, :mod:`multigpu.sim.dryrun`,
:mod:`multigpu.infer.dryrun`) shards the data, agents or windows as rank r would and,
where it can, steps once on fake tensors (torch's ``FakeTensorMode``: shapes and dtypes, no memory) inside
a ``fake`` process group of N ranks (torch's ``FakeStore``: every collective returns at once). Each memory
figure says whether it was *measured* on those fake tensors (torch's ``MemTracker`` counts their storages)
or *estimated* from a formula. Every error a real run at that size would hit is listed; the command then
ends with the first as one line, exit code 2 — also when the peak does not fit ``--device-memory``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

from multigpu.errors import ConfigError, DeviceError
from multigpu.units import format_bytes

__all__ = ["GPUS", "MAX_WORLD_SIZE", "Figure", "Report", "dry_run", "fake_world", "parse_device_memory", "plan_for"]

GPUS_PER_NODE = 8
"""Ranks per node assumed when ``--nproc-per-node`` gives no number."""

MAX_WORLD_SIZE = 1 << 20
"""The most ranks a dry run plans: torch's ``fake`` process group keeps an entry per rank (1,048,576 ranks took
10 s and 450 MB here; a billion ended in a MemoryError after 27 s)."""

# ``--device-memory``: ``80GB``, ``40GiB``, ``81559MiB`` or a GPU name. Decimal units are decimal (``80GB`` = 80 ×
# 10⁹ bytes) and binary units binary (``80GiB`` = 80 × 2³⁰); a GPU name means the memory ``nvidia-smi`` reports for
# that card, which is what ``torch.cuda.mem_get_info`` starts from, less the CUDA context's few hundred MiB.
_MIB = 2**20
GPUS: dict[str, int] = {
    "H200": 143771 * _MIB,
    "H100": 81559 * _MIB,  # SXM and PCIe 80GB
    "H100-NVL": 95830 * _MIB,
    "A100": 81920 * _MIB,  # the 80GB card
    "A100-80GB": 81920 * _MIB,
    "A100-40GB": 40960 * _MIB,
    "L40S": 46068 * _MIB,
    "L4": 23034 * _MIB,
    "A10G": 23028 * _MIB,
    "A10": 23028 * _MIB,
    "RTX4090": 24564 * _MIB,
    "V100": 32768 * _MIB,
    "V100-16GB": 16384 * _MIB,
    "T4": 15360 * _MIB,
}
"""Memory of known GPUs as ``nvidia-smi`` reports it (MiB × 2²⁰)."""

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_device_memory(text: str) -> tuple[int, str]:
    """``(bytes, label)`` of a ``--device-memory`` value; one-line ConfigError naming what is valid."""
    key = text.strip().upper().replace(" ", "").replace("_", "-")
    if key in GPUS:
        return GPUS[key], f"{key} ({GPUS[key] // _MIB:,} MiB)"
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]I?B|B)", key)  # a unit always: a bare 80 is not 80 bytes
    if match and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _UNITS[match.group(2)]), text.strip()
    raise ConfigError(f"--device-memory {text!r} is invalid; valid: a size such as 80GB, 40GiB or 24000MiB, "
                      f"or a GPU name: {', '.join(GPUS)}")


@dataclass
class Figure:
    """One per-rank memory figure."""

    name: str
    bytes: int | None
    how: str
    """"measured" (fake tensors), "estimated" (a formula, said in ``note``), or "not measured"."""
    note: str = ""


@dataclass
class Report:
    """What a dry run found for rank ``rank`` of ``world_size``."""

    lines: list[str] = field(default_factory=list)
    """What rank r gets (its samples, agents, windows) and how the figures were obtained."""
    memory: list[Figure] = field(default_factory=list)
    peak: Figure | None = None
    """The figure compared with the device memory."""
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def plan_for(launch_cfg, world_size: int, device_memory: int | None, resume: str | None = None):
    """The :class:`~multigpu.jobs.workload.JobPlan` of a job of ``world_size`` ranks (nothing probed)."""
    from multigpu.jobs.workload import JobPlan
    from multigpu.launch.devices import DevicePlan
    from multigpu.runtime.context import RunContext

    per_node = launch_cfg.nproc_per_node if isinstance(launch_cfg.nproc_per_node, int) else GPUS_PER_NODE
    per_node = min(per_node, world_size)
    gpus = [] if launch_cfg.cpu else [str(i) for i in range(per_node)]
    devices = DevicePlan(nproc_per_node=per_node, gpu_ids=gpus, gpu_memory_bytes=None if launch_cfg.cpu else device_memory,
                         available_bytes=device_memory * per_node if launch_cfg.cpu and device_memory else None)
    launch = dataclasses.replace(launch_cfg, nproc_per_node=per_node, nnodes=math.ceil(world_size / per_node))
    return JobPlan(launch, devices, world_size, RunContext(run_dir=None, resume=resume))


@contextlib.contextmanager
def fake_world(rank: int, world_size: int):
    """torch's ``fake`` process group: this process is rank ``rank`` of ``world_size``; collectives return at once."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run_check(workload, cfg, plan, report: Report) -> Any:
    """The workload's own check, as the launcher of a real job runs it; its error is the report's first."""
    from multigpu.launch.devices import HostFacts

    if workload.check is None:
        return cfg
    try:
        return workload.check(cfg, plan) or cfg
    except DeviceError as exc:
        if "cuda" in plan.device_types and HostFacts.probe().gpu_count == 0:
            report.warnings.append(f"not checked here (this machine has no GPU to ask): {exc}")
        else:
            report.errors.append(str(exc))
    except ConfigError as exc:
        report.errors.append(str(exc))
    return None


def dry_run(workload, cfg, launch_cfg, args: argparse.Namespace) -> int:
    """``multigpu <workload> ... --dry-run --world-size N``: print the report; raise ConfigError (exit 2) on
    the first error a real run would hit, or when the peak per rank does not fit ``--device-memory``."""
    world_size, rank = args.world_size, args.dry_run_rank
    if world_size is None:
        raise ConfigError("--dry-run needs --world-size N (the job's ranks, e.g. 64)")
    if world_size > MAX_WORLD_SIZE:
        raise ConfigError(f"--world-size {world_size}: a dry run plans at most {MAX_WORLD_SIZE:,} ranks (torch's "
                          f"process group keeps an entry per rank); valid: 1 to {MAX_WORLD_SIZE:,}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"--dry-run-rank {rank} is not a rank of {world_size}; valid: 0 to {world_size - 1}")
    limit, label = parse_device_memory(args.device_memory) if args.device_memory else (None, "")
    plan = plan_for(launch_cfg, world_size, limit, getattr(args, "resume", None))
    report = Report()
    checked = _run_check(workload, cfg, plan, report)
    if workload.dry_run is None:
        report.warnings.append(f"the {workload.name} workload has no dry-run measurement: its check ran, "
                               "memory is not measured")
    else:
        workload.dry_run(checked if checked is not None else cfg, plan, rank, report)
    report.errors = list(dict.fromkeys(report.errors))  # the check and the step may find the same
    _print(workload.name, plan, rank, report, limit, label)
    if report.errors:
        more = f" (and {len(report.errors) - 1} more error(s) listed above)" if len(report.errors) > 1 else ""
        raise ConfigError(report.errors[0] + more)
    peak = report.peak
    if limit is not None and peak is not None and peak.bytes is not None and peak.bytes > limit:
        raise ConfigError(f"does not fit: rank {rank} of {world_size} needs about {format_bytes(peak.bytes)} "
                          f"({peak.name}, {peak.how}) but --device-memory is {label} = {format_bytes(limit)}; "
                          "valid: more ranks (fsdp shards the training state), a smaller batch or model, "
                          "or a device with more memory")
    return 0


def _print(name: str, plan, rank: int, report: Report, limit: int | None, label: str) -> None:
    where = "CPU ranks" if plan.launch.cpu else "GPUs"
    print(f"multigpu {name} --dry-run: rank {rank} of {plan.world_size} ({plan.launch.nnodes} node(s) × "
          f"{plan.devices.nproc_per_node} {where}); nothing spawned, nothing written", flush=False)
    for line in report.lines:
        print(f"  {line}")
    if report.memory:
        print(f"  memory of rank {rank}:")
        width = max(len(f.name) for f in report.memory)
        for f in report.memory:
            size = format_bytes(f.bytes) if f.bytes is not None else "-"
            print(f"    {f.name:<{width}}  {size:>10}  {f.how}" + (f" ({f.note})" if f.note else ""))
    peak = report.peak
    if peak is not None and peak.bytes is not None:
        if limit is None:
            print("  fits: not checked (give --device-memory 80GB, or a GPU name such as H100, A100-40GB, L4)")
        else:
            verdict = "yes" if peak.bytes <= limit else "NO"
            print(f"  fits {label}: {verdict} ({format_bytes(peak.bytes)} of {format_bytes(limit)}, "
                  f"{peak.bytes / limit:.1%})")
    for line in report.warnings:
        print(f"  warning: {line}")
    for line in report.errors:
        print(f"  error: {line}")
    import sys

    sys.stdout.flush()
