"""Peak memory of sliding-window inference on a very large image (16k x 16k by default), 1 and 2 ranks.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/infer_memory.py [--size 16384] [--roi 512]

One-channel uint8 input (windows are cast to float32 one batch at a time), the
Gaussian denoiser demo model, overlap 0.25, batch 8. Each rank reports its peak
RSS; the figures to compare are the input (every rank holds it), rank 0's
float32 output, each rank's canvas (the box its windows touch, sums + weights),
and what keeping every window output would have cost.
"""

from __future__ import annotations

import argparse
import resource
import time

import psutil
import torch

import multigpu as mg
from multigpu.infer import WindowPlan, sliding_window
from multigpu.infer.models import denoiser
from multigpu.testing import run_on_ranks


def _body(size: int, roi: int) -> dict:
    x = torch.randint(0, 256, (1, 1, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    model = denoiser(channels=1, sigma=1.0)
    baseline = psutil.Process().memory_info().rss
    start = time.perf_counter()
    out = sliding_window(x, model, roi, 0.25, 8, "gaussian", progress=False)
    seconds = time.perf_counter() - start
    return {"rank": mg.rank(), "s": seconds, "baseline_mib": baseline / 2**20,
            "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "out_shape": None if out is None else tuple(out.shape),
            "out_mean": None if out is None else float(out.mean())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=16384)
    parser.add_argument("--roi", type=int, default=512)
    parser.add_argument("--ranks", default="1,2")
    args = parser.parse_args()
    n = WindowPlan([(args.size, args.size)], (args.roi, args.roi), (0.25, 0.25)).num_windows
    mib = args.size**2 / 2**20
    print(f"input 1x1x{args.size}x{args.size} uint8 ({mib:.0f} MiB), output float32 ({4 * mib:.0f} MiB), "
          f"roi {args.roi}: {n} windows, whose outputs together would be {n * args.roi**2 * 4 / 2**20:.0f} MiB")
    for world in (int(w) for w in args.ranks.split(",")):
        for r in run_on_ranks(_body, world, args=(args.size, args.roi), timeout_s=3000):
            print(f"  {world} rank(s), rank {r['rank']}: {r['s']:6.1f} s, peak RSS {r['peak_mib']:6.0f} MiB "
                  f"(baseline with the input {r['baseline_mib']:.0f} MiB)"
                  + (f", output {r['out_shape']} mean {r['out_mean']:.4f}" if r["out_shape"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
