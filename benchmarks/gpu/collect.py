"""Merge one step of the GPU run into its results file, merge calls, and print the summary (used by run_all.sh).

    python3 benchmarks/gpu/collect.py RESULTS.json --meta                      # start: the machine and the source
    python3 benchmarks/gpu/collect.py RESULTS.json --step train --status ok --rc 0 --seconds 171 \\
        --started 2026-11-28T10:00:05+0000 --record train.json
    python3 benchmarks/gpu/collect.py RESULTS.json --step tests_work --status failed --rc 1 --seconds 50 --junit pytest.xml
    python3 benchmarks/gpu/collect.py RESULTS.json --summary
    python3 benchmarks/gpu/collect.py MERGED.json --merge CALL1.json CALL2.json   # later calls' steps win

The file is rewritten (atomically) after every step, so a run cut short still
leaves the steps it finished. Layout::

    {"machine": {...}, "source": {"commit": "...", "text": "abc1234", ...}, "started": "...",
     "steps": {"tests_work": {"status": "ok", "rc": 0, "seconds": 50, "started": "...", "call": "...",
               "commit": "abc1234", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130",
               "tests": {"passed": 12, "failed": 0, ...}},
               "train": {..., "record": {...}}},
     "targets": {"train: mfu >= 0.45": true}}

Every step's entry says which source, GPU and torch ran it, when it started (``started``) and in which call
(``call``: that call's start): the source from run_all.sh (``GPU_RUN_SOURCE``), the torch from ``TORCH_VERSION``
where set, else the machine's (``--meta``). A
step's status agrees with its counts: a test chunk whose tests all passed but whose pytest exited non-zero reads
``rc N, no test failed``, not ``failed``; a benchmark whose peer could not run reads ``peer missing``.
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
    return {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": None, "source": None, "steps": {},
            "targets": {}}


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


def tests_status(status: str, rc: int | None, tests: dict) -> str:
    """A test chunk's status as its counts tell it: ``failed`` only when a test failed."""
    failed = tests["failures"] + tests["errors"]
    if failed:
        return "failed"
    if status == "failed" and tests["passed"] > 0:  # pytest's own exit after every test passed (a session hook)
        return f"rc {rc}, no test failed"
    return status


def _source() -> dict:
    """What run_all.sh found with benchmarks/gpu/source.py (``GPU_RUN_SOURCE``); unknown without it."""
    try:
        return json.loads(os.environ["GPU_RUN_SOURCE"])
    except (KeyError, ValueError):
        return {"commit": None, "text": "unknown: GPU_RUN_SOURCE not set (run through run_all.sh)"}


def add_step(data: dict, args: argparse.Namespace) -> None:
    machine = data.get("machine") or {}
    source = data.get("source") or _source()
    step = {"status": args.status, "rc": args.rc, "seconds": args.seconds, "started": args.started,
            "call": data.get("started"), "commit": source.get("text"), "gpu": machine.get("gpu") or "none (no GPU)",
            "torch": os.environ.get("TORCH_VERSION") or machine.get("torch")}
    if args.note:
        step["note"] = args.note
    if args.record:
        record = Path(args.record)
        if record.exists():
            step["record"] = json.loads(record.read_text())
            for name, ok in (step["record"].get("targets") or {}).items():
                data["targets"][f"{args.step}: {name}"] = ok
            missing = step["record"].get("peer_missing")
            if missing:  # said in the row, never a silent "—"
                step["peer_missing"] = missing
                if args.status == "ok":
                    step["status"] = "peer missing"
        elif args.status != "skipped":
            step["note"] = (step.get("note", "") + " no record written").strip()
    if args.junit and Path(args.junit).exists():
        step["tests"] = junit_summary(Path(args.junit))
        t = step["tests"]  # all skipped (no CUDA seen) is not a pass
        data["targets"][f"{args.step}: every gpu test passed"] = t["failures"] + t["errors"] == 0 and t["passed"] > 0
        step["status"] = tests_status(args.status, args.rc, t)
    data["steps"][args.step] = step


PEERS = {"monai": "infer", "gymnasium": "envs", "envpool": "envs (optional)"}
"""The peers' distributions and the step that compares against each."""


def meta(data: dict) -> bool:
    """The call's facts, in one Python start: the machine (torch, GPU, driver), the source, multigpu (it must
    import: False otherwise) and the peers' versions, a missing one said loudly (its step's row says it too)."""
    from importlib import metadata

    sys.path.insert(0, str(Path(__file__).parent))
    import _common

    data["machine"] = _common.machine()
    data["source"] = _source()
    try:
        import multigpu
    except Exception as exc:  # noqa: BLE001 - any import failure stops the call, with its reason
        print(f"multigpu does not import: {type(exc).__name__}: {exc}")
        return False
    peers = {}
    for dist in PEERS:
        try:
            peers[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            peers[dist] = None
    data["peers"] = peers
    machine = data["machine"]
    print(f"multigpu from {Path(multigpu.__file__).parent}; torch {machine['torch']}, GPU {machine.get('gpu')}; "
          f"source {data['source'].get('text')}")
    print("peers: " + ", ".join(f"{d} {v or 'MISSING'}" for d, v in peers.items()))
    for dist, version in peers.items():
        if version is None and "optional" not in PEERS[dist]:
            print(f"PEER MISSING: {dist} is not installed here, so the {PEERS[dist]} step measures ours alone and its "
                  "row says so; run bash benchmarks/gpu/fetch_wheels.sh where PyPI is and carry .whl")
    return True


def merge(paths: list[Path]) -> dict:
    """Several calls' results as one: each step from the last call that ran it (a skipped step does not replace
    one that ran), each keeping the call it came from; the machine and source of the last call."""
    out = {"started": None, "machine": None, "source": None, "steps": {}, "targets": {}, "calls": []}
    for path in paths:
        data = json.loads(path.read_text())
        out["calls"].append({"started": data.get("started"), "source": data.get("source"), "file": path.name})
        out["started"] = out["started"] or data.get("started")
        out["machine"], out["source"] = data.get("machine") or out["machine"], data.get("source") or out["source"]
        for name, step in data.get("steps", {}).items():
            if step.get("status") == "skipped" and name in out["steps"]:
                continue
            step = {"call": data.get("started"), **step}
            if "tests" in step:  # a chunk's status as its counts tell it (calls recorded before this rule too)
                step["status"] = tests_status(step["status"], step.get("rc"), step["tests"])
            out["steps"][name] = step
            out["targets"] = {k: v for k, v in out["targets"].items() if k.split(": ", 1)[0] != name}
            out["targets"].update({k: v for k, v in data.get("targets", {}).items() if k.split(": ", 1)[0] == name})
    return out


def summary(data: dict, path: Path) -> None:
    machine = data.get("machine") or {}
    source = data.get("source") or {}
    print(f"GPU run on {machine.get('gpu')} (driver {machine.get('driver')}, torch {machine.get('torch')}), "
          f"source {source.get('text')}:")
    for name, step in data["steps"].items():
        extra = ""
        if "tests" in step:
            t = step["tests"]
            extra = f" {t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped"
        if step.get("peer_missing"):
            extra += f" PEER MISSING: {step['peer_missing']}"
        print(f"  {name:<12} {step['status']:<8} rc={step['rc']} {step['seconds'] or 0:.0f}s{extra} {step.get('note', '')}")
    for name, ok in data["targets"].items():
        print(f"  target {name}: {ok}")
    print(f"results: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("--meta", action="store_true", help="record the machine's facts (imports torch) and the source")
    p.add_argument("--step")
    p.add_argument("--status", choices=["ok", "failed", "timeout", "skipped"])
    p.add_argument("--rc", type=int)
    p.add_argument("--seconds", type=float)
    p.add_argument("--started", help="when the step started (ISO 8601)")
    p.add_argument("--record", help="the benchmark's JSON record")
    p.add_argument("--junit", help="pytest's JUnit XML")
    p.add_argument("--note")
    p.add_argument("--merge", nargs="+", metavar="CALL.json", help="merge these calls' results into RESULTS")
    p.add_argument("--summary", action="store_true", help="print every step's status and target")
    args = p.parse_args()
    path = Path(args.results)
    if args.merge:
        try:
            data = merge([Path(m) for m in args.merge])
        except (OSError, ValueError) as exc:
            print(f"error: cannot merge {' '.join(args.merge)}: {exc}", file=sys.stderr)
            return 2
        _save(path, data)
        print(f"merged {len(args.merge)} call(s) into {path}")
        return 0
    data = _load(path)
    if args.meta and not meta(data):
        return 1
    if args.step:
        add_step(data, args)
    _save(path, data)
    if args.summary:
        summary(data, path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
