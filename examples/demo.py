"""`make demo`: run the built-in workloads on every available device and say what each achieved.

Each part runs through the real command line (`python -m multigpu ...`), so the
demo shows exactly what a user would type. Where there is no GPU, every part
runs on two CPU ranks (gloo).

    python examples/demo.py                        # all parts
    python examples/demo.py hello                  # just the named part(s)
    python examples/demo.py --run-dir /tmp/d sim   # the runs' folders under /tmp/d (default runs/demo/<time>)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_DIR = ROOT / "runs" / "demo" / time.strftime("%Y%m%d-%H%M%S")
"""A fresh folder per demo run: a run directory that already holds a run is refused without --resume."""


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_flags() -> list[str]:
    """All GPUs where there are some; else two CPU ranks."""
    return ["--gpus", "all"] if _gpu_count() else ["--nproc-per-node", "2"]


def bench_flags() -> list[str]:
    """GPUs where there are two or more; else CPU ranks (gloo)."""
    return [] if _gpu_count() >= 2 else ["--cpu"]


def parts(run_dir: Path) -> list[tuple[str, str, list[str]]]:
    """(name, title, argv after `multigpu`) of every part, their runs written under ``run_dir``."""
    bench_dir = run_dir / "bench"
    return [
        ("hello", "shard a list, compute on each rank, gather in order on rank 0",
         ["launch", *device_flags(), "examples/hello.py"]),
        ("sim", "SIR epidemic, ten million agents, grid split across ranks (epidemic curve CSV + plot)",
         ["sim", "-f", "sir", "--agents", "10_000_000", "--steps", "25", *device_flags(),
          "--strategy", "spatial", "--run-dir", str(run_dir / "sim")]),
        ("train", "a short nano-GPT training on the stdlib's source: falling validation loss, then sample text",
         ["train", "-f", "nano", *device_flags(), "--run-dir", str(run_dir / "train"),
          "steps=30", "eval_every=10", "log_every=10", "model.kwargs.n_embd=128", "checkpoint_every=0",
          "sample_chars=200"]),
        ("infer", "denoise a noisy sample photo in overlapping windows, each window on one rank, stitched on rank 0",
         ["infer", *device_flags(), "--model", "multigpu.infer.models:denoiser",
          "--run-dir", str(run_dir / "infer"), "--roi", "128", "--overlap", "0.25", "--batch-size", "4",
          "--blend", "gaussian"]),
        ("envs", "CartPole PPO: environments split over the ranks, policy in DDP, until mean return >= 475",
         ["rl", *device_flags(), "-f", "ppo-cartpole", "--run-dir", str(run_dir / "rl"),
          "total_env_steps=1500000"]),
        ("bench", "measure what a second rank gains: speedup, efficiency, communication share, imbalance",
         ["bench", "--nproc", "1,2", *bench_flags(), "-o", str(bench_dir), "examples/allreduce_dp.py"]),
        ("report", "one self-contained HTML page: scaling table and plots, utilization, throughput over time",
         ["report", str(bench_dir)]),
    ]


def main(argv: list[str]) -> int:
    run_dir = RUN_DIR
    if argv[:1] == ["--run-dir"]:
        if len(argv) < 2:
            print("error: --run-dir needs a folder, e.g. --run-dir /tmp/demo", file=sys.stderr)
            return 2
        run_dir, argv = Path(argv[1]), argv[2:]
    every = parts(run_dir)
    wanted = set(argv) or {name for name, _, _ in every}
    unknown = wanted - {name for name, _, _ in every}
    if unknown:
        print(f"error: unknown demo part(s) {sorted(unknown)}; valid: {[n for n, _, _ in every]}", file=sys.stderr)
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    summary = []
    for name, title, args in every:
        if name not in wanted:
            continue
        print(f"\n=== {name}: {title}\n$ multigpu {' '.join(args)}", flush=True)
        start = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "multigpu", *args], cwd=ROOT, env=env)
        summary.append((name, code, time.perf_counter() - start))
    print("\n=== demo summary")
    for name, code, seconds in summary:
        print(f"  {name:<10} {'ok' if code == 0 else f'FAILED (exit {code})':<16} {seconds:6.1f} s")
    return 0 if all(code == 0 for _, code, _ in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
