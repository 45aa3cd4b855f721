"""Checkpoints from GPU ranks: ``benchmarks/checkpoint_async.py --cuda`` as a step of the GPU call, in its record.

    python benchmarks/gpu/checkpoint_gpu.py [--size quick|full|smoke] [--models nano,big] [--dir PATH]
    python benchmarks/gpu/checkpoint_gpu.py --quick     # CPU ranks, the small MLP at the smoke size

Runs checkpoint_async.py's contenders as they are (``run_mode``: 2 ranks training with DDP and AdamW through
``multigpu.run.Run``, a checkpoint every 10 steps, once ``checkpoint_mode=sync`` and once ``async``; on one GPU both
ranks share it over gloo, on two NCCL) with ``--cuda``: the training runs on the GPU and the staging copies go
through pinned memory, the writer thread has the host's cores. At ``--size quick`` (the default here, to fit the
call): the nano GPT (23 MB checkpoints) and a 3 x 2048^2 MLP (151 MB), 30 steps. Figures per model and mode: the
stall per checkpoint, the step while a write runs, the write's throughput against this disk's own sequential write
bandwidth measured right before and after each run.

Targets (checkpoint_async.py's): async stall <= 5% of the sync stall; async throughput >= 70% of the disk's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import _common

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import checkpoint_async  # noqa: E402 - the CPU benchmark's contenders, run as they are

SIZES = {"full": (4096, 3, 16, 40, 10), "quick": (2048, 3, 16, 30, 10), "smoke": (256, 2, 4, 6, 3)}
"""width, layers, batch, steps, checkpoint every (checkpoint_async.py's sizes)."""


def estimate(size: str, models: list[str]) -> dict[str, float]:
    """Seconds on one GPU: the start, 2 ranks' start per run (the forkserver's torch once, CUDA in each), and each
    run's checkpoints written and the disk measured twice at 0.5 GB/s (a VM's disk; the H200 machine's is not known)."""
    width, layers, _, steps, every = SIZES[size]
    parts = {"start": _common.STARTUP_S, "forkserver": 5.0}
    for kind in models:
        nbytes = 23e6 if kind == "nano" else 3 * 4 * layers * width * width
        parts[kind] = 2 * (4.0 + (steps // every + 2) * nbytes / 0.5e9)
    return parts


def main() -> int:
    p = _common.parser(__doc__)
    p.add_argument("--size", choices=list(SIZES), default="quick")
    p.add_argument("--models", default=None, help="nano, big or nano,big (default: both; --quick: big, at its "
                                                   "smoke size the smaller)")
    p.add_argument("--dir", help="where the checkpoints go (default: a temporary folder)")
    _common.add_estimate_flag(p)
    args = p.parse_args()
    size = "smoke" if args.quick else args.size
    spec = args.models or ("big" if args.quick else "nano,big")
    models = [m for m in spec.split(",") if m]
    if not models or any(m not in ("nano", "big") for m in models):
        print(f"error: --models {args.models!r}: valid: nano, big or nano,big", file=sys.stderr)
        return 2
    if args.estimate:
        return _common.print_estimate(estimate(size, models))
    import torch

    device = _common.pick_device("cpu" if args.quick and args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    width, layers, batch, steps, every = SIZES[size]
    ns = argparse.Namespace(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0, width=width, layers=layers,
                            batch=batch, steps=steps, every=every, threads=1)
    folder = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-gpu-"))
    folder.mkdir(parents=True, exist_ok=True)
    print(f"checkpoints on {'GPU' if cuda else 'CPU'} ranks ({ns.gpus} GPU(s)), size {size}, models {models}, "
          f"into {folder}", flush=True)
    rows, targets = [], {}
    for kind in models:
        model, _ = checkpoint_async._model(kind, width, layers)
        nbytes = max(3 * sum(q.numel() * q.element_size() for q in model.parameters()), 8 << 20)
        del model
        by_mode = {}
        for mode in ("sync", "async"):
            before = checkpoint_async.disk_bandwidth(folder, nbytes)
            row = by_mode[mode] = checkpoint_async.run_mode(kind, mode, folder, ns)
            row["disk MB/s"] = statistics.mean((before, checkpoint_async.disk_bandwidth(folder, nbytes))) / 1e6
            row["write / disk"] = row["write MB/s"] / row["disk MB/s"]
            rows.append(row)
            print(f"  {kind} {mode}: stall {row['stall per checkpoint (s)']:.3f} s per checkpoint, write "
                  f"{row['write MB/s']:.0f} MB/s of the disk's {row['disk MB/s']:.0f}", flush=True)
        stall = by_mode["async"]["stall per checkpoint (s)"] / by_mode["sync"]["stall per checkpoint (s)"]
        targets[f"{kind}: async stall <= 5% of sync"] = stall <= 0.05
        targets[f"{kind}: async write >= 70% of the disk"] = by_mode["async"]["write / disk"] >= 0.70
        by_mode["async"]["async stall / sync stall"] = stall
    if not args.dir:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    worst = max(r["async stall / sync stall"] for r in rows if "async stall / sync stall" in r)
    _common.write_record(args.json, {
        "benchmark": "checkpoint_gpu", "machine": _common.machine(),
        "config": {"size": size, "models": models, "width": width, "layers": layers, "steps": steps, "every": every,
                   "ranks": 2, "placement": ("NCCL, 2 GPUs" if ns.gpus >= 2 else "2 ranks share GPU 0 over gloo")
                   if cuda else "2 CPU ranks, gloo"},
        "ours": rows, "summary": f"async stall {worst:.1%} of sync at worst",
        "peer": {"name": "sync checkpoints and the disk's own sequential write bandwidth, same run"},
        "ratio": worst, "targets": targets,
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
