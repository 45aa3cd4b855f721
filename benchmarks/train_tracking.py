"""What `logger: wandb` costs a training run: the same job with and without it, rounds alternating.

    flock /tmp/multigpu-bench.lock .venv/bin/python -u benchmarks/train_tracking.py [--rounds 3 --steps 40]

Runs ``multigpu train`` (the nano GPT, made small; 2 CPU ranks; a metrics record at every step, the worst case
for a tracker) twice per round: once with ``logger=[]`` (console and metrics.jsonl only) and once with
``--logger wandb`` in offline mode (``WANDB_MODE=offline``: the run's files are written, nothing is sent).
Per round: the wall time from starting the command to its exit (start-up, W&B's init on rank 0 and its
finish included) and the steady-state tokens/s from ``summary.json`` (steps after the first two). Prints
both figures per round, and wandb / none ratios. Needs ``pip install wandb``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(tracker: str, steps: int, nproc: int, folder: Path) -> tuple[float, float]:
    run_dir = folder / f"{tracker}-{time.time_ns()}"
    logger = ["--logger", "wandb", "wandb.project=bench"] if tracker == "wandb" else ["logger=[]"]
    argv = [sys.executable, "-m", "multigpu", "train", "-f", "nano", "model.kwargs.n_layer=2", "model.kwargs.n_embd=64",
            "model.kwargs.n_head=2", "block_size=64", "batch_size=8", f"steps={steps}", "log_every=1", "eval_every=0",
            "checkpoint_every=0", "sample_chars=0", *logger, "--nproc-per-node", str(nproc), "--run-dir", str(run_dir)]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{tracker}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    if tracker == "wandb" and not list((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        raise SystemExit("wandb: no offline run was written")
    return wall, json.loads((run_dir / "summary.json").read_text())["throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    import wandb

    print(f"wandb {wandb.__version__}; {args.nproc} CPU ranks, {args.steps} steps, a record every step; "
          f"load average at start {os.getloadavg()[0]:.2f}", flush=True)
    print("| round | none wall (s) | wandb wall (s) | wall ratio | none tokens/s | wandb tokens/s | tokens/s ratio |")
    print("|---|---|---|---|---|---|---|")
    walls, rates = [], []
    with tempfile.TemporaryDirectory(prefix="bench-tracking-") as tmp:
        for r in range(1, args.rounds + 1):
            order = ("none", "wandb") if r % 2 else ("wandb", "none")  # alternate who goes first
            got = {t: _run(t, args.steps, args.nproc, Path(tmp)) for t in order}
            (w0, t0), (w1, t1) = got["none"], got["wandb"]
            walls.append(w1 / w0)
            rates.append(t1 / t0)
            print(f"| {r} | {w0:.1f} | {w1:.1f} | {w1 / w0:.2f} | {t0:,.0f} | {t1:,.0f} | {t1 / t0:.2f} |", flush=True)
    print(f"wall ratio (wandb / none) per round: {', '.join(f'{x:.2f}' for x in walls)}; "
          f"tokens/s ratio: {', '.join(f'{x:.2f}' for x in rates)}; load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
