"""Shared by the side-by-side benchmarks: --quick/--smoke/--json and the one JSON record each script writes.

Runs in the benchmark script's own process (outside any rank). A script adds
the flags with :func:`add_flags` and, with ``--json PATH``, writes::

    {"benchmark": "infer_vs_monai", "mode": "quick", "config": {...},
     "rows": [{"round": 1, "contender": "ours, 1 rank", "windows/s": 61.2, ...}, ...],
     "ratios": [{"name": "ours / MONAI windows/s", "round": 1, "value": 1.02}, ...],
     "notes": ["MONAI 1.5.1"], "machine": {...}}

``rows`` are the per-round figures (one flat dict each: the renderer makes a
table of them); ``ratios`` are what the comparison is about, per round where
the benchmark has rounds. ``--quick`` is the size `make bench` runs
(benchmarks/run_all.py); ``--smoke`` is the tiny size the test suite runs so
the scripts never rot (tests/unit/test_benchmark_smoke.py): its figures mean nothing.
Imports no torch, so the runner can use it too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any


def add_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --quick, --smoke and --json to a benchmark's parser."""
    parser.add_argument("--quick", action="store_true", help="the size `make bench` runs (minutes for the whole set)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for the test suite (seconds; figures mean nothing)")
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable record here")
    return parser


def mode(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "quick" if args.quick else "full"


def version(dist: str) -> str | None:
    """An installed distribution's version, or None (without importing it)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """What a figure was measured on: cores, memory, load, torch."""
    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform(), "host": platform.node(),
                            "torch": version("torch"), "load_average": list(os.getloadavg())}
    try:
        import psutil

        info["memory_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    return info


def write(args: argparse.Namespace, benchmark: str, config: dict, rows: list[dict], ratios: list[dict],
          notes: list[str] | None = None) -> dict:
    """Build the record and write it to ``args.json`` (when given); return it."""
    record = {"benchmark": benchmark, "mode": mode(args), "config": config, "rows": rows, "ratios": ratios,
              "notes": notes or [], "machine": machine()}
    if getattr(args, "json", None):
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    return record


def ratio(name: str, value: float | None, round_: int | None = None, **extra: Any) -> dict:
    """One ratio entry (``round`` None = over the whole run)."""
    return {"name": name, "round": round_, "value": value, **extra}
