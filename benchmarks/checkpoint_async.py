"""Checkpoints in the background: the training step's stall per checkpoint, sync vs async, and the write
throughput against this disk's own sequential write bandwidth, side by side in one run.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/checkpoint_async.py [--quick|--smoke] [--json PATH]
    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/checkpoint_async.py --dir /scratch/ckpt --cuda

Runs outside the ranks; each contender is a run of 2 real gloo ranks (``multigpu.testing.run_on_ranks``; with
``--cuda``, NCCL ranks on 2 GPUs, or 2 ranks sharing one GPU over gloo) that trains a model with DDP and AdamW through :class:`multigpu.run.Run`,
a checkpoint every ``--every`` steps, once with ``checkpoint_mode=sync`` and once with ``async``. Two models:

* ``nano``: the nano preset's GPT (4 layers, 192 wide: about 1.9M parameters, a checkpoint of about 23 MB);
* ``big``: an MLP of ``--layers`` square layers ``--width`` wide (full size: 3 × 4096² = 50M parameters,
  201 MB of weights, a checkpoint of about 604 MB with AdamW's two moments).

Figures, per model and mode:

* **stall per checkpoint**: seconds the training loop is held in a save (sync: the whole write; async: the
  staging copy, plus any wait for the previous write: "waits" counts them, 0 where the cadence leaves time);
* **step slowdown while writing**: the median step time while a background write runs over the median step
  time without one (the writer's thread shares the host: on a 2-core CPU machine it competes with the step);
* **write throughput**: checkpoint bytes over the write's own time (sync: in the save; async: on the writer
  thread, from its start to the rename), against the **disk's sequential write bandwidth** measured in the
  same folder in the same run (a file of the checkpoint's size in 8 MiB writes, then fsync: what a
  checkpoint can reach at best), right before and right after each run.

Targets: async stall <= 5% of the sync stall; async throughput >= 70% of the disk's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]


def disk_bandwidth(folder: Path, nbytes: int, chunk: int = 8 << 20) -> float:
    """Bytes/s of one sequential write of ``nbytes`` into ``folder``, fsync included (dd conv=fsync)."""
    path = folder / ".disk_bandwidth.tmp"
    block = os.urandom(chunk)  # incompressible, as tensors are
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(chunk, left)])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
    path.unlink()
    return nbytes / seconds


def _model(kind: str, width: int, layers: int):
    import torch

    if kind == "nano":
        from multigpu.train.model import GPT
        from multigpu.train.nano import ModelConfig

        return GPT(ModelConfig(n_layer=4, n_head=4, n_embd=192, block_size=128), 96), ("tokens", 128, 96)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks), ("dense", width, None)


def _rank(kind: str, mode: str, run_dir: str, steps: int, every: int, width: int, layers: int, batch: int) -> dict:
    """On every rank: ``steps`` DDP steps of the model with a checkpoint every ``every``; the timings."""
    import torch
    import torch.nn.functional as F

    import multigpu as mg
    from multigpu.checkpoint import PerRank, RngState
    from multigpu.run import Run, script_context
    from multigpu.train.strategies import wrap_ddp

    torch.manual_seed(0)
    module, (what, size, vocab) = _model(kind, width, layers)
    device = mg.device()
    module.to(device)
    model, _ = wrap_ddp(module, mg.get_env("bench"), "auto")
    opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
    state = {"model": module, "optimizer": opt, "rng": PerRank(RngState())}
    run = Run(script_context(run_dir), state, total=steps, checkpoint_every=every, keep_last=2, mode=mode,
              checkpoint_last=False, progress=False)
    gen = torch.Generator(device=device).manual_seed(mg.rank())
    times, writing = [], []
    for _ in run.steps(timed=False):
        start = time.perf_counter()
        with run.meter.step(items=batch):
            if what == "tokens":
                x = torch.randint(0, vocab, (batch, size), device=device, generator=gen)
                loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
            else:
                x = torch.randn(batch, size, device=device, generator=gen)
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        writing.append(run.checkpoints.writing is not None)
    run.close()
    ck = run.checkpoints
    last = ck.last or ck.store.latest()
    files = json.loads((last / "manifest.json").read_text())["files"] if last is not None else {}
    return {"step_s": times, "writing": writing, "stall_s": ck.stall_s, "write_s": ck.write_s,
            "bytes": sum(f["bytes"] for f in files.values()), "waits": ck.waits}


def run_mode(kind: str, mode: str, folder: Path, args) -> dict:
    from multigpu.testing import run_on_ranks

    run_dir = folder / f"{kind}-{mode}"
    placement: dict = {}
    if args.cuda:  # NCCL on 2 GPUs; on a one-GPU machine both ranks share it over gloo (as the launcher does)
        from multigpu.runtime.context import RunContext

        placement = ({"env": {"CUDA_VISIBLE_DEVICES": "0,1"}} if args.gpus >= 2 else
                     {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "ctx": RunContext(isolated=True, pg_backend="gloo")})
    results = run_on_ranks(_rank, 2, args=(kind, mode, str(run_dir), args.steps, args.every, args.width, args.layers,
                                           args.batch), timeout_s=1800, threads=args.threads,
                           backend="cuda" if args.cuda else "cpu", **placement)
    r0 = results[0]  # rank 0 writes state.pt: its save holds the most
    step = [max(a, b) for a, b in zip(results[0]["step_s"], results[1]["step_s"], strict=True)]
    quiet = [t for t, w in zip(step[1:], r0["writing"][:-1], strict=True) if not w]  # steps with no write under way
    busy = [t for t, w in zip(step[1:], r0["writing"][:-1], strict=True) if w]
    # per save, the rank held longest; the first save also makes the host buffers (its own column)
    stall = [max(a, b) for a, b in zip(results[0]["stall_s"], results[1]["stall_s"], strict=True)]
    write_s = statistics.median(r0["write_s"]) if r0["write_s"] else float("nan")
    return {"model": kind, "mode": mode, "checkpoint MB": r0["bytes"] / 1e6, "checkpoints": len(stall),
            "stall per checkpoint (s)": statistics.median(stall[1:] or stall), "first stall (s)": stall[0],
            "waits": r0["waits"],
            "step (s)": statistics.median(quiet) if quiet else statistics.median(step),
            "step while writing / step": (statistics.median(busy) / statistics.median(quiet)) if busy and quiet else None,
            "write (s)": write_s, "write MB/s": r0["bytes"] / write_s / 1e6}


def main() -> int:
    parser = _record.add_flags(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--dir", help="where the checkpoints go (default: a temporary folder, $TMPDIR)")
    parser.add_argument("--cuda", action="store_true",
                        help="GPU ranks (pinned staging): NCCL on GPUs 0 and 1, or both on GPU 0 over gloo")
    parser.add_argument("--models", default="nano,big", help="nano, big or both")
    args = parser.parse_args()
    size = _record.mode(args)
    args.width, args.layers, args.batch = {"full": (4096, 3, 16), "quick": (2048, 3, 16), "smoke": (256, 2, 4)}[size]
    args.steps, args.every = {"full": (40, 10), "quick": (30, 10), "smoke": (6, 3)}[size]
    args.threads = 1
    args.gpus = 0
    if args.cuda:
        import torch

        args.gpus = torch.cuda.device_count()
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    rows, ratios = [], []
    for kind in args.models.split(","):
        model, _ = _model(kind, args.width, args.layers)
        nbytes = max(3 * sum(p.numel() * p.element_size() for p in model.parameters()), 8 << 20)  # + AdamW's 2
        del model
        by_mode = {}
        for mode in ("sync", "async"):
            # the disk right before and right after the run: a shared disk's speed moves from minute to minute
            before = disk_bandwidth(folder, nbytes)
            row = by_mode[mode] = run_mode(kind, mode, folder, args)
            row["disk MB/s"] = statistics.mean((before, disk_bandwidth(folder, nbytes))) / 1e6
            row["write / disk"] = row["write MB/s"] / row["disk MB/s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        sync, asyn = by_mode["sync"], by_mode["async"]
        ratios.append(_record.ratio(f"{kind}: async stall / sync stall (target <= 0.05)",
                                    float(asyn["stall per checkpoint (s)"] / sync["stall per checkpoint (s)"])))
        ratios.append(_record.ratio(f"{kind}: async write throughput / disk (target >= 0.70)",
                                    float(asyn["write / disk"])))
        ratios.append(_record.ratio(f"{kind}: sync write throughput / disk", float(sync["write / disk"])))
    for r in ratios:
        print(f"{r['name']}: {r['value']:.3f}", flush=True)
    _record.write(args, "checkpoint_async", {"size": size, "dir": str(folder), "steps": args.steps, "every": args.every,
                                             "big": f"{args.layers} x {args.width}^2 MLP, AdamW", "cuda": args.cuda},
                  rows, ratios)
    if not args.dir:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
