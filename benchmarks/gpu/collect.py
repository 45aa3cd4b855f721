"""Merge one step of the GPU run into its results file, and print the summary (used by run_all.sh).

    python3 benchmarks/gpu/collect.py RESULTS.json --meta                      # start: the machine's facts
    python3 benchmarks/gpu/collect.py RESULTS.json --step train --status ok --rc 0 --seconds 171 --record train.json
    python3 benchmarks/gpu/collect.py RESULTS.json --step tests_work --status failed --rc 1 --seconds 50 --junit pytest.xml
    python3 benchmarks/gpu/collect.py RESULTS.json --summary

The file is rewritten (atomically) after every step, so a run cut short still
leaves the steps it finished. Layout::

    {"machine": {...}, "started": "...", "steps": {"tests_work": {"status": "ok", "rc": 0, "seconds": 50,
     "torch": "2.11.0+cu130", "tests": {"passed": 12, "failed": 0, ...}}, "train": {..., "record": {...}}},
     "targets": {"train: mfu >= 0.40": true}}

Every step's entry says which torch ran it (``TORCH_VERSION``, set by run_all.sh; else the machine's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(path: Path) -> dict:
    if path.exists():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": None, "steps": {}, "targets": {}}


def _save(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def junit_summary(path: Path) -> dict:
    """Counts and the failing tests (with the first line of their message) from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failing, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag in ("failure", "error"):
            for item in case.findall(tag):
                message = (item.get("message") or item.text or "").strip().splitlines()
                failing.append({"test": name, "kind": tag, "message": message[0][:500] if message else ""})
        for item in case.findall("skipped"):
            skipped.append({"test": name, "reason": (item.get("message") or "")[:300]})
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {**counts, "failing": failing, "skipped_tests": skipped}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--meta", action="store_true", help="record the machine's facts (imports torch)")
    p.add_argument("--step")
    p.add_argument("--status", choices=["ok", "failed", "timeout", "skipped"])
    p.add_argument("--rc", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--record", help="the benchmark's JSON record")
    p.add_argument("--junit", help="pytest's JUnit XML")
    p.add_argument("--note")
    p.add_argument("--summary", action="store_true", help="print every step's status and target")
    args = p.parse_args()
    path = Path(args.results)
    data = _load(path)
    if args.meta:
        sys.path.insert(0, str(Path(__file__).parent))
        import _common

        data["machine"] = _common.machine()
    if args.step:
        step = {"status": args.status, "rc": args.rc, "seconds": args.seconds,
                "torch": os.environ.get("TORCH_VERSION") or (data.get("machine") or {}).get("torch")}
        if args.note:
            step["note"] = args.note
        if args.record:
            record = Path(args.record)
            if record.exists():
                step["record"] = json.loads(record.read_text())
                for name, ok in (step["record"].get("targets") or {}).items():
                    data["targets"][f"{args.step}: {name}"] = ok
            elif args.status != "skipped":
                step["note"] = (step.get("note", "") + " no record written").strip()
        if args.junit and Path(args.junit).exists():
            step["tests"] = junit_summary(Path(args.junit))
            t = step["tests"]  # all skipped (no CUDA seen) is not a pass
            data["targets"][f"{args.step}: every gpu test passed"] = t["failures"] + t["errors"] == 0 and t["passed"] > 0
        data["steps"][args.step] = step
    _save(path, data)
    if args.summary:
        machine = data.get("machine") or {}
        print(f"GPU run on {machine.get('gpu')} (driver {machine.get('driver')}, torch {machine.get('torch')}):")
        for name, step in data["steps"].items():
            extra = ""
            if "tests" in step:
                t = step["tests"]
                extra = f" {t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped"
            print(f"  {name:<12} {step['status']:<8} rc={step['rc']} {step['seconds'] or 0:.0f}s{extra} {step.get('note', '')}")
        for name, ok in data["targets"].items():
            print(f"  target {name}: {ok}")
        print(f"results: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
