"""Training-state memory per rank and step time, strategy=ddp vs fsdp, on 1, 2 and 3 CPU ranks.

    flock /tmp/multigpu-bench.lock .venv/bin/python -u benchmarks/train_fsdp_memory.py [--n-layer 12 --n-embd 768]

The built-in GPT (character vocabulary), the same global batch on every world
size, ``--steps`` optimizer steps (the first is not timed). Each configuration
runs in its own spawned ranks, one thread per rank. Per rank (the largest
rank's figure): the planned training state (parameters + gradients + Adam's
two moments, :func:`multigpu.train.strategy_checks.training_state_bytes`), the measured
one (the bytes of this rank's local parameter, gradient and optimizer-state
tensors after the last step, before ``zero_grad``), the peak RSS during setup
(under fsdp on 2 or more ranks the model is built on meta and each rank
materializes only its shards, as ``multigpu train`` does), the RSS after setup
and after a step, the peak RSS of the whole run, and the median step time.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import psutil
import torch

import multigpu as mg
from multigpu.testing import run_on_ranks


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor):
            continue
        t = t.to_local() if hasattr(t, "to_local") else t
        total += t.numel() * t.element_size()
    return total


def _mmap_threshold(nbytes: int) -> None:
    """glibc's ``mallopt(M_MMAP_THRESHOLD, nbytes)``: freed blocks above it go back to the system, so RSS follows
    the live tensors. Set here, in the rank: ``MALLOC_MMAP_THRESHOLD_`` in the environment is read when a
    process starts, and run_on_ranks' ranks start (from a fork server) before the environment reaches them."""
    import ctypes

    if nbytes and not ctypes.CDLL("libc.so.6").mallopt(-3, nbytes):  # -3: M_MMAP_THRESHOLD
        raise RuntimeError("mallopt(M_MMAP_THRESHOLD) failed")


def _body(strategy: str, n_layer: int, n_embd: int, block: int, batch: int, steps: int, mmap: int = 0) -> dict:
    _mmap_threshold(mmap)
    from multigpu.train import ModelConfig, TrainConfig, Trainer, make_optimizer
    from multigpu.train.data import VOCAB, CharDataset
    from multigpu.train.meta import build_on_meta
    from multigpu.train.model import GPT
    from multigpu.train.strategy_checks import training_state_bytes

    cfg = TrainConfig(steps=steps, global_batch_size=batch, eval_every=0, log_every=0, checkpoint_every=0,
                      prefetch=0, warmup_steps=1, strategy=strategy)
    torch.manual_seed(0)
    shape = ModelConfig(n_layer=n_layer, n_head=max(1, n_embd // 64), n_embd=n_embd, block_size=block)
    if strategy == "fsdp" and mg.world_size() > 1:  # as `multigpu train` builds it: on meta, then only the shards
        model = build_on_meta(lambda: GPT(shape, len(VOCAB)), "GPT")
    else:
        model = GPT(shape, len(VOCAB))
    optimizer = make_optimizer(model, cfg)
    tokens = torch.randint(0, len(VOCAB), (block * batch * 4 + 1,), generator=torch.Generator().manual_seed(1),
                           dtype=torch.uint8)
    trainer = Trainer(model, optimizer, CharDataset(tokens, block), config=cfg).setup()
    setup_rss = psutil.Process().memory_info().rss  # fsdp: only this rank's shards were ever materialized
    setup_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    planned = sum(training_state_bytes(trainer.module, mg.world_size(), trainer.strategy.sharded).values())
    times, state, step_rss = [], 0, []
    real_zero = optimizer.zero_grad

    def measure_then_zero(set_to_none: bool = True):  # the state is largest here: grads and moments both exist
        nonlocal state
        params = list(trainer.module.parameters())
        moments = [v for s in optimizer.state.values() for v in s.values()]
        state = _local_bytes(params) + _local_bytes(p.grad for p in params) + _local_bytes(moments)
        real_zero(set_to_none=set_to_none)

    optimizer.zero_grad = measure_then_zero
    for _ in range(steps):
        start = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - start)
        step_rss.append(psutil.Process().memory_info().rss)
        trainer.step += 1
    trainer.close()
    return {"planned": planned, "state": state, "setup_rss": setup_rss, "setup_peak": setup_peak,
            "step_rss": max(step_rss), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "step_s": statistics.median(times[1:]), "params": sum(p.numel() for p in model.parameters())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch", type=int, default=6, help="global batch (divisible by 1, 2 and 3)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--runs", default="ddp:1,ddp:2,fsdp:2,ddp:3,fsdp:3")
    parser.add_argument("--mmap-threshold", type=int, default=1 << 20,
                        help="glibc's mmap threshold in the ranks (mallopt): freed blocks above it go back to the "
                             "system, so RSS follows live tensors instead of keeping freed ones (0: glibc's default)")
    args = parser.parse_args()
    mib = 2**20
    print("| strategy | ranks | params | planned state/rank | measured state/rank | peak RSS in setup | RSS after setup "
          "| RSS after a step | peak RSS/rank | step time |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in args.runs.split(","):
        strategy, ranks = run.split(":")
        out = run_on_ranks(_body, int(ranks), args=(strategy, args.n_layer, args.n_embd, args.block, args.batch,
                                                    args.steps, args.mmap_threshold), timeout_s=1200)
        keys = ("planned", "state", "setup_peak", "setup_rss", "step_rss", "peak_rss")
        worst = {k: max(r[k] for r in out) for k in (*keys, "step_s")}
        print(f"| {strategy} | {ranks} | {out[0]['params'] / 1e6:.1f}M | "
              + " | ".join(f"{worst[k] / mib:,.0f} MiB" for k in keys) + f" | {worst['step_s']:.2f} s |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
