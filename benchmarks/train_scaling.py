"""Benchmark: nano GPT scaling from 1 to 2 ranks (CPU here), with the communication share.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/train_scaling.py [--steps 30] [--nproc 1,2]

Strong scaling: the global batch stays 32 samples of 128 characters
(``global_batch_size=32``), split over the ranks; each rank gets cores / ranks
threads (the launcher's default). Figures come from the run's summary.json
(StepMeter: tokens of all ranks / the slowest rank's time over the steps after
the first 2; comm share = time gradient all-reduces were in flight / step time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(nproc: int, steps: int, tmp: Path, extra: list[str]) -> dict:
    run_dir = tmp / f"n{nproc}"
    cmd = [sys.executable, "-m", "multigpu", "train", "-f", "nano", "--nproc-per-node", str(nproc),
           "--run-dir", str(run_dir), f"steps={steps}", "global_batch_size=32", "log_every=0", "eval_every=0",
           "checkpoint_every=0", "sample_chars=0", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. sync_backend=cpu")
    args = parser.parse_args()
    counts = [int(n) for n in args.nproc.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        rows = [(n, run(n, args.steps, Path(tmp), args.overrides)) for n in counts]
    base = rows[0][1]["throughput"]
    print(f"nano GPT, global batch 32 × 128 tokens, {args.steps} steps {' '.join(args.overrides)}")
    print(f"{'ranks':>5}{'tokens/s':>11}{'speedup':>9}{'efficiency':>12}{'comm share':>12}{'step (s)':>10}")
    for n, s in rows:
        speedup = s["throughput"] / base
        print(f"{n:>5}{s['throughput']:>11,.0f}{speedup:>8.2f}x{speedup / (n / counts[0]):>11.0%}"
              f"{s['comm_share']:>11.0%}{s['step_time_s']['median']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
