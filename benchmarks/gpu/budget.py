"""The GPU call's time budget, checked on a CPU: does each step's own estimate of its GPU run fit its cap?

    python benchmarks/gpu/budget.py                    # every step of run_all.sh
    python benchmarks/gpu/budget.py --steps train sim  # only these
    TRAIN_S=90 TRAIN_ARGS="--steps 200" python benchmarks/gpu/budget.py --steps train   # as run_all.sh would run

Reads run_all.sh itself: each step's cap (``TRAIN_S=${TRAIN_S:-110}``, the environment's value first, as the
script takes it), each benchmark step's script and its ``*_ARGS``, and each test chunk's files. A benchmark's
estimate is what its ``--estimate`` prints (its full-size run on one H100, from its own arguments); a test
chunk's is pytest's start plus seconds per collected test (``TEST_SECONDS``). One process: the scripts are run
in it, the tests collected in it. Prints ``budget NAME: estimate E s of cap C s (...)`` per step and, for the whole
call, ``budget call: ... of CALL_S ...`` (setup, every step's estimate and the render one after the other), and
exits 1 when any estimate exceeds its cap or the call's: a change that would make a step overrun on the GPU (more
tests in a chunk, more steps or sizes in a benchmark) fails here, in ``make test`` (run_all.sh's ``REHEARSE=1``),
not in the GPU call.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PYTEST_START_S = 10.0
"""pytest starting, importing torch and collecting its files on the GPU machine."""
TEST_SECONDS = {"test_launch_gpu.py": 6.0, "test_train_gpu.py": 6.0, "test_monitor_doctor_gpu.py": 8.0,
                "test_sim_gpu.py": 4.0}
"""A GPU test's seconds on one GPU, by file: the launcher's end-to-end jobs start processes of their own; the
others from the first GPU call (one H200, 2026-11-27: training's DDP tests 8-16 s with their 2-rank fixture, the
doctor's test starts a 2-rank job)."""
DEFAULT_TEST_S = 3.0
SETUP_ESTIMATE_S = 30.0
"""run_all.sh's setup on the GPU machine: two Python starts that import torch (the GPU's probe; the machine's record
with multigpu and the peers), source.py, and two pip installs (the first GPU call's setup, with six starts, took 44 s)."""


def plan(script: str) -> dict[str, dict]:
    """``{step: {"cap": seconds, "script": path, "args": [...]} or {"cap": ..., "tests": [files]}}`` from run_all.sh."""
    caps = {name: int(os.environ.get(name, default))
            for name, default in re.findall(r"^(\w+_S)=\$\{\1:-(\d+)\}", script, flags=re.M)}
    chunks = {name: value.split() for name, value in re.findall(r'^(TESTS_\w+)="([^"]*)"', script, flags=re.M)}
    steps: dict[str, dict] = {}
    for name, cap, path, args in re.findall(r'^bench_step (\w+)\s+"\$(\w+_S)"\s+(\S+)\s*\$\{(\w+_ARGS)', script,
                                            flags=re.M):
        steps[name] = {"cap": caps[cap], "script": path, "args": shlex.split(os.environ.get(args, ""))}
    for name, cap, files in re.findall(r'^tests_step (\w+)\s+"\$(\w+_S)"\s+"\$(\w+)"', script, flags=re.M):
        steps[name] = {"cap": caps[cap], "tests": chunks[files]}
    return steps


def collected(files: list[str]) -> list[str]:
    """The GPU tests of ``files`` (``path::name[params]``, the path from the repository root), collected by pytest in
    this process."""
    if not files:
        return []
    import pytest

    class Keep:
        def __init__(self):
            self.ids: list[str] = []

        def pytest_collection_modifyitems(self, items):
            self.ids += [item.nodeid for item in items if item.get_closest_marker("gpu")]

    keep = Keep()
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT), *files], plugins=[keep])
    return keep.ids


def _of(ids: list[str], files: list[str]) -> list[str]:
    """The collected tests that belong to ``files`` (paths as run_all.sh names them, from the repository root)."""
    mine = {(ROOT / f).resolve() for f in files}
    return [test for test in ids if (ROOT / test.split("::")[0]).resolve() in mine]


def tests_estimate(ids: list[str]) -> dict[str, float]:
    parts: dict[str, float] = {"pytest start": PYTEST_START_S}
    for test in ids:
        name = Path(test.split("::")[0]).name
        parts[name] = parts.get(name, 0.0) + TEST_SECONDS.get(name, DEFAULT_TEST_S)
    return parts


def script_estimate(path: str, args: list[str]) -> dict[str, float]:
    """What ``python PATH --estimate ARGS`` prints, run in this process."""
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(f"_budget_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    out, argv = io.StringIO(), sys.argv
    sys.argv = [path, "--estimate", *args]
    try:
        with contextlib.redirect_stdout(out):
            rc = module.main()
    finally:
        sys.argv = argv
    for line in reversed(out.getvalue().splitlines()):
        if line.startswith("ESTIMATE "):
            return json.loads(line.split(" ", 2)[2])
    raise ValueError(f"{path} --estimate {' '.join(args)} printed no 'ESTIMATE <seconds> {{...}}' line (rc {rc})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", nargs="*", help="only these steps (default: all)")
    p.add_argument("--run-all", default=str(HERE / "run_all.sh"))
    args = p.parse_args()
    steps = plan(Path(args.run_all).read_text())
    unknown = sorted(set(args.steps or ()) - set(steps))
    if unknown:
        print(f"error: no step {', '.join(unknown)} in run_all.sh; valid: {', '.join(steps)}", file=sys.stderr)
        return 2
    chosen = {name: step for name, step in steps.items() if not args.steps or name in args.steps}
    # every chunk's tests in one collection (pytest's start and its conftest imports once, not once per chunk)
    ids = collected([f for step in chosen.values() for f in step.get("tests", ())])
    over, estimates = [], {}
    for name, step in chosen.items():
        parts = tests_estimate(_of(ids, step["tests"])) if "tests" in step else script_estimate(step["script"],
                                                                                                 step["args"])
        total = estimates[name] = sum(parts.values())
        if total > step["cap"] or ("tests" in step and len(parts) == 1):
            over.append(name)
        print(f"budget {name}: estimate {total:.0f} s of cap {step['cap']} s "
              f"({'fits' if name not in over else 'OVER'}): " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items()),
              flush=True)
    if over:
        print(f"budget: {', '.join(over)} would not fit its cap on the GPU (or collected no test): cut the step, or "
              "raise its cap in run_all.sh within CALL_S", file=sys.stderr)
    if not args.steps or set(args.steps) == set(steps):  # the whole call: every step one after the other
        call = call_limits(Path(args.run_all).read_text())
        need = SETUP_ESTIMATE_S + sum(estimates.values()) + call["RENDER_S"]
        fits = need <= call["CALL_S"]
        print(f"budget call: setup {SETUP_ESTIMATE_S:.0f} s + the steps' estimates {sum(estimates.values()):.0f} s + "
              f"render {call['RENDER_S']} s = {need:.0f} s of CALL_S {call['CALL_S']} s ({'fits' if fits else 'OVER'})",
              flush=True)
        if not fits:
            print("budget: the steps' estimates together exceed one call: move a step to a second call "
                  "(STEPS=...) or cut one", file=sys.stderr)
            return 1
    return 1 if over else 0


def call_limits(script: str) -> dict[str, int]:
    """CALL_S and RENDER_S as run_all.sh sets them (the environment's value first, as the script takes it)."""
    out = {k: int(v) for k, v in re.findall(r"^(CALL_S)=(\d+)\b", script, flags=re.M)}
    out |= {name: int(os.environ.get(name, default)) for name, default in
            re.findall(r"^(RENDER_S)=\$\{\1:-(\d+)\}", script, flags=re.M)}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
