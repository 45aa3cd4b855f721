"""`make demo`: run the built-in workloads on every available device and say what each achieved.

Each part runs through the real command line (`python -m multigpu ...`), so the
demo shows exactly what a user would type. Where there is no GPU, every part
runs on two CPU ranks (gloo).

    python examples/demo.py            # all parts
    python examples/demo.py hello      # just the named part(s)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_DIR = ROOT / "runs" / "demo"


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_flags() -> list[str]:
    """All GPUs where there are some; else two CPU ranks."""
    return ["--gpus", "all"] if _gpu_count() else ["--nproc-per-node", "2"]


# (name, title, argv after `multigpu`); later workloads add their part here.
PARTS: list[tuple[str, str, list[str]]] = [
    ("hello", "shard a list, compute on each rank, gather in order on rank 0",
     ["launch", *device_flags(), "examples/hello.py"]),
    ("sim", "SIR epidemic, ten million agents, grid split across ranks (epidemic curve CSV + plot)",
     ["sim", "-f", "configs/sir.yaml", "--agents", "10_000_000", "--steps", "25", *device_flags(),
      "--strategy", "spatial", "--run-dir", str(RUN_DIR / "sim")]),
]


def main(argv: list[str]) -> int:
    wanted = set(argv) or {name for name, _, _ in PARTS}
    unknown = wanted - {name for name, _, _ in PARTS}
    if unknown:
        print(f"error: unknown demo part(s) {sorted(unknown)}; valid: {[n for n, _, _ in PARTS]}", file=sys.stderr)
        return 2
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    summary = []
    for name, title, args in PARTS:
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
