"""Benchmark: nano GPT scaling from 1 to 2 ranks (CPU here), with the communication share.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/train_scaling.py [--steps 30] [--nproc 1,2]
    .venv/bin/python benchmarks/train_scaling.py --quick --json out.json     # what `make bench` runs

Strong scaling: the global batch stays 32 samples of 128 characters
(``global_batch_size=32``), split over the ranks; every rank gets one thread
(``--threads 1``) on 1 rank and on 2, so the speedup is that of adding a rank,
not of trading one 2-thread rank for two 1-thread ranks (``--threads 0``: the
launcher's default, cores / ranks). Figures come from the run's summary.json
(StepMeter: tokens of all ranks / the slowest rank's time over the steps after
the first 2; comm share = time gradient all-reduces were in flight / step time).
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


def run(nproc: int, steps: int, tmp: Path, extra: list[str], threads: int = 1) -> dict:
    run_dir = tmp / f"n{nproc}"
    cmd = [sys.executable, "-m", "multigpu", "train", "-f", "nano", "--nproc-per-node", str(nproc),
           *(["--threads", str(threads)] if threads else []), "--run-dir", str(run_dir), f"steps={steps}",
           "global_batch_size=32", "log_every=0", "eval_every=0", "checkpoint_every=0", "sample_chars=0", *extra]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return {**json.loads((run_dir / "summary.json").read_text()), "load": os.getloadavg()[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--nproc", default="1,2")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. sync_backend=cpu")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the world sizes in turn (1, 2, 1, 2, ...)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank, the same at every world size "
                        "(0: the launcher's default, cores // ranks)")
    args = _record.add_flags(parser).parse_args()
    if args.quick:
        args.steps, args.rounds = 12, 2
    if args.smoke:  # one tiny 1-rank run: checks the script, not the speed
        args.steps, args.nproc, args.rounds = 3, "1", 1
        args.overrides += ["model.kwargs.n_layer=1", "model.kwargs.n_embd=32", "model.kwargs.n_head=2",
                           "data.kwargs.max_chars=20000"]  # a tiny GPT on a little text: seconds, not a figure
    counts = [int(n) for n in args.nproc.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        runs = [(r + 1, n, run(n, args.steps, Path(tmp) / f"r{r}", args.overrides, args.threads))
                for r in range(args.rounds) for n in counts]
    record_rows, ratios = [], []
    for r, n, s in runs:
        base = next(x for rr, nn, x in runs if rr == r and nn == counts[0])["throughput"]
        record_rows.append({"round": r, "ranks": n, "threads per rank": args.threads or "default",
                            "tokens/s": s["throughput"], "speedup": s["throughput"] / base,
                            "comm share": s["comm_share"], "median step (s)": s["step_time_s"]["median"],
                            "load": s["load"]})
        if n != counts[0]:
            ratios.append(_record.ratio(f"{n} ranks / {counts[0]} tokens/s", s["throughput"] / base, r))
    _record.write(args, "train_scaling", {"steps": args.steps, "nproc": counts, "rounds": args.rounds,
                                          "global_batch_size": 32, "threads": args.threads,
                                          "overrides": args.overrides},
                  record_rows, ratios)
    rows = [(n, s) for r, n, s in runs if r == args.rounds]
    base = rows[0][1]["throughput"]
    threads = f"{args.threads} thread(s) per rank" if args.threads else "cores // ranks threads per rank"
    print(f"nano GPT, global batch 32 × 128 tokens, {args.steps} steps, {threads} {' '.join(args.overrides)}")
    print(f"{'ranks':>5}{'tokens/s':>11}{'speedup':>9}{'efficiency':>12}{'comm share':>12}{'step (s)':>10}")
    for n, s in rows:
        speedup = s["throughput"] / base
        print(f"{n:>5}{s['throughput']:>11,.0f}{speedup:>8.2f}x{speedup / (n / counts[0]):>11.0%}"
              f"{s['comm_share']:>11.0%}{s['step_time_s']['median']:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
