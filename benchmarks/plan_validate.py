"""`multigpu plan` against figures it did not fit: published training throughput and memory (pure computation),
and CPU ranks measured here (fit on 1-2 ranks, predict 3-4 ranks and another thread count, then measure them).

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/plan_validate.py [--json out.json]
    .venv/bin/python benchmarks/plan_validate.py --published-only      # the table alone: seconds, no ranks

Runs outside any rank; each bench is `multigpu bench ... --weak --threads T` in a subprocess (each rank keeps its
batch, so every world size trains the same per-rank step). Prints predicted vs published/measured with the error
for each case, and the targets: within 15% of each published throughput figure from its description alone; within
10% on CPU ranks at 2x the measured size; the memory fit right on every published case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]
JOB = ["train", "-f", "nano", "steps=30", "eval_every=0", "checkpoint_every=0"]


def published() -> list[dict]:
    from multigpu.plan.cases import validate

    rows = validate()
    print("\npublished figures, predicted from the model description alone (tokens/s per GPU):")
    print(f"{'case':78s} {'predicted':>10s} {'published':>10s} {'error':>7s}  memory GiB pred/pub/have  fit")
    for r in rows:
        pub = f"{r['published']:,.0f}" if r["published"] else "—"
        err = f"{r['error']:+.1%}" if r["error"] is not None else "—"
        mem = f"{r['memory_gib']:.1f}/{r['published_memory_gib'] or '—'}/{r['have_gib']:.1f}"
        fit = ("fits" if r["fits"] else "OOM") + (" (right)" if r["fit_right"] else " (WRONG)")
        print(f"{r['name'][:78]:78s} {r['predicted']:>10,.0f} {pub:>10s} {err:>7s}  {mem:>24s}  {fit}"
              + ("" if r["target"] else "  [not held to the target]"))
    return rows


def _bench(nproc: str, threads: int, out: Path, smoke: bool) -> dict:
    job = [*JOB[:3], "steps=6" if smoke else JOB[3], *JOB[4:]]
    cmd = [sys.executable, "-m", "multigpu", "bench", "--nproc", nproc, "--weak", "--threads", str(threads),
           "--run-dir", str(out), *job]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    print("$ " + " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads((out / "bench.json").read_text())


def _measured_step(bench: dict, n: int) -> float:
    from multigpu.bench.predict import _mean_step

    return next(_mean_step(r["summary"]) for r in bench["runs"] if r["world_size"] == n)


def cpu_ranks(tmp: Path, smoke: bool) -> list[dict]:
    from multigpu.plan.measured import MeasuredJob

    fit = _bench("1,2", 1, tmp / "fit", smoke)
    job = MeasuredJob.load(tmp / "fit")
    cases = [(3, 1), (4, 1), (1, 2), (2, 2)]
    predicted = {c: job.cpu_step(*c) for c in cases}
    wide = _bench("3,4", 1, tmp / "wide", smoke)
    threads = _bench("1,2", 2, tmp / "threads", smoke)
    rows = []
    print("\nCPU ranks (nano GPT, weak scaling, fitted on 1 and 2 ranks x 1 thread):")
    for n, t in cases:
        measured = _measured_step(wide if t == 1 else threads, n)
        step = predicted[(n, t)]["step_s"]
        rows.append({"case": f"{n} rank(s) x {t} thread(s)", "predicted_ms": step * 1e3, "measured_ms": measured * 1e3,
                     "error": step / measured - 1, "how": predicted[(n, t)]["roofline"]})
        print(f"  {rows[-1]['case']:24s} predicted {step * 1e3:8.1f} ms  measured {measured * 1e3:8.1f} ms  "
              f"error {step / measured - 1:+.1%}   ({predicted[(n, t)]['roofline']})")
    rows.append({"case": "fitted sizes (measured)", "measured_ms": [_measured_step(fit, 1) * 1e3,
                                                                    _measured_step(fit, 2) * 1e3]})
    return rows


def main() -> int:
    parser = _record.add_flags(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--published-only", action="store_true", help="the published cases alone (no ranks)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    rows = published()
    cpu = []
    if not args.published_only:
        with tempfile.TemporaryDirectory(prefix="plan_validate_") as tmp:
            cpu = cpu_ranks(Path(tmp), args.smoke)
    on_target = [r for r in rows if r["error"] is not None and r["target"]]
    met = [r for r in on_target if abs(r["error"]) <= 0.15]
    print(f"\npublished: {len(met)} of {len(on_target)} throughput cases within 15%; memory fit right on "
          f"{sum(r['fit_right'] for r in rows)} of {len(rows)}")
    if cpu:
        at2x = [r for r in cpu if r.get("error") is not None and r["case"].startswith("4 ")]
        print("CPU ranks at 2x the measured size (4 ranks): " + ", ".join(f"{r['error']:+.1%}" for r in at2x)
              + " (target: within 10%)")
    if args.json:
        table = [{"round": 1, "contender": r["name"], "predicted": r["predicted"], "published": r["published"],
                  "error": r["error"], "memory_gib": r["memory_gib"], "fit_right": r["fit_right"]} for r in rows]
        table += [{"round": 2, "contender": r["case"], **{k: v for k, v in r.items() if k != "case"}} for r in cpu]
        ratios = [{"name": f"predicted / published: {r['name']}", "round": 1, "value": float(1 + r["error"])}
                  for r in rows if r["error"] is not None]
        ratios += [{"name": f"predicted / measured: {r['case']}", "round": 2, "value": float(1 + r["error"])}
                   for r in cpu if r.get("error") is not None]
        _record.write(args, "plan_validate", {"job": JOB}, table, ratios, [])
    return 0


if __name__ == "__main__":
    sys.exit(main())
