"""``multigpu info``: the devices, variables and backends this machine offers (runs in the launcher)."""

from __future__ import annotations

import argparse
import json
import os

HELP = "show devices, visible-device variables, backends and versions"


def add_parser(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("info", help=HELP, description=HELP)
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def collect() -> dict:
    """The facts ``multigpu info`` prints, as plain data."""
    import psutil
    import torch
    import torch.distributed as dist

    from multigpu.launch.devices import DEVICE_VARIABLES
    from multigpu.runtime.env import cpu_count

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    mps = getattr(torch.backends, "mps", None)
    return {
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "hip_build": getattr(torch.version, "hip", None),
        "gpus": gpus,
        "mps": bool(mps and mps.is_available()),
        "cores": cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "backends": {
            "nccl": dist.is_nccl_available(),
            "gloo": dist.is_gloo_available(),
            "mpi": dist.is_mpi_available(),
        },
        "variables": {name: os.environ.get(name) for name in DEVICE_VARIABLES},
    }


def run(args: argparse.Namespace) -> int:
    facts = collect()
    if args.json:
        print(json.dumps(facts, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title="multigpu info", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value")
    build = facts["cuda_build"] and f"CUDA {facts['cuda_build']}" or facts["hip_build"] and f"ROCm {facts['hip_build']}" or "CPU"
    table.add_row("torch", f"{facts['torch']} ({build} build)")
    if facts["gpus"]:
        for g in facts["gpus"]:
            table.add_row(f"GPU {g['index']}", f"{g['name']}, {g['memory_gib']} GiB")
    else:
        table.add_row("GPUs", "none visible: ranks run on the CPU (gloo)")
    table.add_row("MPS", "yes" if facts["mps"] else "no")
    table.add_row("CPU cores", str(facts["cores"]))
    table.add_row("memory", f"{facts['memory_gib']} GiB")
    table.add_row("backends", ", ".join(k for k, v in facts["backends"].items() if v) or "none")
    for name, value in facts["variables"].items():
        table.add_row(name, "(unset)" if value is None else repr(value))
    Console().print(table)
    return 0
