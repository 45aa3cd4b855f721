"""Per-step breakdown of nano GPT training: our Trainer vs the raw DDP loop, on every rank (run by `torchrun`).

    OMP_NUM_THREADS=1 flock /tmp/multigpu-bench.lock .venv/bin/torchrun --standalone --nproc-per-node 2 \\
        benchmarks/train_step_profile.py [--steps 30] [--rounds 2] [k=v ...]

Times each phase of a step with wall-clock timers (median over the steps
after the first 2, rank 0's and the slowest rank's): data fetch, forward,
backward (with DDP's gradient all-reduce, which overlaps it), clip, optimizer,
zero_grad, scheduler, and what the step does besides. Our Trainer is timed
by wrapping its parts from outside (no code of ours changes for it); the raw
loop is written out (benchmarks/_train_peer.py's). Also reported, in the same
run: backward under ``no_sync()`` (compute only), so backward minus it is the
all-reduce time that the backward pass did not hide, and a bare all-reduce of
the model's gradient size (one flat buffer, and DDP's bucket sizes) over gloo.
The ``cpu`` column is the process's CPU time per step (all its threads): on a
shared host, where wall times swing with other jobs, it is the steadier figure
of how much work a loop does per step.

``--only`` picks contenders, alternating in every round: ``raw``, ``raw-view``
(DDP with ``gradient_as_bucket_view``), ``nosync``, ``ours``, ``ours:k=v:...``
(our trainer with config overrides, e.g. ``ours:prefetch=0``) and
``ours-nohook`` (DDP's built-in all-reduce instead of our timed hook).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn.functional as F

from multigpu.jobs.command import load_workload_config
from multigpu.jobs.registry import builtin

WARMUP = 2
PHASES = ["data", "forward", "backward", "clip", "optimizer", "zero_grad", "scheduler", "other", "step", "cpu"]


class Timers:
    def __init__(self):
        self.t = defaultdict(list)
        self.cur: dict[str, float] = {}
        self.cpu = time.process_time()

    @contextlib.contextmanager
    def phase(self, name):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.cur[name] = self.cur.get(name, 0.0) + time.perf_counter() - start

    def wrap(self, name, fn):
        def timed(*a, **k):
            with self.phase(name):
                return fn(*a, **k)
        return timed

    def end_step(self, total):
        self.cur["step"] = total
        self.cur["other"] = total - sum(v for k, v in self.cur.items() if k != "step")
        cpu, self.cpu = self.cpu, time.process_time()
        self.cur["cpu"] = self.cpu - cpu  # this process's CPU time (all its threads) since the previous step
        for k in PHASES:
            self.t[k].append(self.cur.get(k, 0.0))
        self.cur = {}


def loss_of(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def run_raw(cfg, steps, sync=True, **ddp_kwargs):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    from multigpu.train.job import _context
    from multigpu.train.optim import make_optimizer, make_scheduler

    data, _ = cfg.data.build("data.factory", _context(cfg))
    torch.manual_seed(cfg.seed)
    model = cfg.model.build("model.factory", _context(cfg, data.vocab_size))
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg)
    model = DDP(model, **ddp_kwargs)
    sampler = DistributedSampler(data, seed=cfg.seed, drop_last=True)
    loader = DataLoader(data, batch_size=cfg.batch_per_rank(dist.get_world_size()), sampler=sampler, drop_last=True)
    it = iter(loader)
    tm = Timers()
    for _ in range(steps):
        start = time.perf_counter()
        with tm.phase("data"):
            x, y = next(it)
        with model.no_sync() if not sync else contextlib.nullcontext():
            with tm.phase("forward"):
                loss = loss_of(model, x, y)
            with tm.phase("backward"):
                loss.backward()
        with tm.phase("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        with tm.phase("optimizer"):
            opt.step()
        with tm.phase("zero_grad"):
            opt.zero_grad(set_to_none=True)
        with tm.phase("scheduler"):
            sched.step()
        tm.end_step(time.perf_counter() - start)
    return tm


def fit_ours(cfg, steps):
    from dataclasses import replace

    from multigpu.train.job import build

    cfg = replace(cfg, steps=steps)
    trainer, _, _ = build(cfg, None)
    trainer.setup()
    tm = Timers()
    inner = trainer.batches

    class Timed:
        def __next__(self):
            with tm.phase("data"):
                return next(inner)

        def close(self):
            inner.close()

    trainer.batches = Timed()
    trainer.loss_fn = tm.wrap("forward", trainer.loss_fn)
    trainer._clip_gradients = tm.wrap("clip", trainer._clip_gradients)
    trainer.optimizer.step = tm.wrap("optimizer", trainer.optimizer.step)
    trainer.optimizer.zero_grad = tm.wrap("zero_grad", trainer.optimizer.zero_grad)
    trainer.scheduler.step = tm.wrap("scheduler", trainer.scheduler.step)
    loop: list[float] = []

    class Mark:  # ends each step's record; the gaps between marks are whole fit() iterations
        def on_step(self, _):
            loop.append(time.perf_counter())
            tm.end_step(trainer.meter.step_times[-1])

    trainer.callbacks.append(Mark())
    backward = torch.Tensor.backward

    def timed_backward(self, *a, **k):
        with tm.phase("backward"):
            return backward(self, *a, **k)

    torch.Tensor.backward = timed_backward
    try:
        trainer.fit()
    finally:
        torch.Tensor.backward = backward
    trainer.close()
    gaps = [b - a for a, b in zip(loop, loop[1:], strict=False)]
    return tm, gaps


def allreduce_times(model_numel, bucket_numels, reps=20):
    """Median seconds of one gloo all-reduce of ``n`` float32 values, for the whole gradient and DDP's buckets."""
    out = {}
    for label, n in [("whole gradient", model_numel)] + [(f"bucket {i}", b) for i, b in enumerate(bucket_numels)]:
        buf = torch.randn(n)
        ts = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            ts.append(time.perf_counter() - start)
        out[label] = (n, statistics.median(ts[2:]))
    return out


def report(name, tm, rank, world):
    meds = {k: statistics.median(tm.t[k][WARMUP:]) for k in PHASES}
    gathered = [None] * world
    dist.all_gather_object(gathered, meds)
    if rank == 0:
        slow = {k: max(g[k] for g in gathered) for k in PHASES}
        print(f"{name[:14]:<14}" + "".join(f"{1e3 * meds[k]:>10.2f}" for k in PHASES)
              + "   | slowest rank step " + f"{1e3 * slow['step']:.2f} ms", flush=True)
    return meds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="raw,nosync,ours")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    # wrapping optimizer.step from outside hides it from the scheduler's "step() before optimizer.step()" check
    warnings.filterwarnings("ignore", message=r"Seems like `optimizer.step\(\)` has been overridden")
    import multigpu as mg

    mg.init()  # gloo on CPU; OMP_NUM_THREADS from torchrun's environment
    rank, world = dist.get_rank(), dist.get_world_size()
    overrides = ["log_every=0", "eval_every=0", "checkpoint_every=0", "sample_chars=0", *args.overrides]
    cfg = load_workload_config(builtin("train"), "nano", overrides)
    if rank == 0:
        print(f"{world} ranks, {torch.get_num_threads()} thread(s) each, batch per rank "
              f"{cfg.batch_per_rank(world)} x {cfg.block_size} tokens; median ms per step after {WARMUP}")
        print(f"{'':<14}" + "".join(f"{k:>10}" for k in PHASES))
    for _ in range(args.rounds):
        for which in args.only.split(","):
            if which == "raw":
                report("raw DDP", run_raw(cfg, args.steps), rank, world)
            elif which == "raw-view":  # DDP's gradients as views into its buckets (no copy in and out)
                report(which, run_raw(cfg, args.steps, gradient_as_bucket_view=True), rank, world)
            elif which == "nosync":
                report("raw no_sync", run_raw(cfg, args.steps, sync=False), rank, world)
            elif which.startswith("ours"):  # "ours" or "ours:k=v:k=v" (our trainer with overrides)
                extra = which.split(":")[1:]
                # "ours-nohook": DDP's built-in all-reduce instead of our timed hook (no comm share then)
                hook = torch.nn.parallel.DistributedDataParallel.register_comm_hook
                if which.startswith("ours-nohook"):
                    torch.nn.parallel.DistributedDataParallel.register_comm_hook = lambda *a, **k: None
                try:
                    tm, gaps = fit_ours(load_workload_config(builtin("train"), "nano", overrides + extra), args.steps)
                finally:
                    torch.nn.parallel.DistributedDataParallel.register_comm_hook = hook
                report(which, tm, rank, world)
                if rank == 0:
                    print(f"{'':<14}ours' whole fit() iteration: median {1e3 * statistics.median(gaps[WARMUP:]):.2f} ms")
    from multigpu.train.job import _context

    data, _ = cfg.data.build("data.factory", _context(cfg))
    model = cfg.model.build("model.factory", _context(cfg, data.vocab_size))
    numel = sum(p.numel() for p in model.parameters())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sizes = str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))  # bytes, "a, b, ..." (DDP's initial buckets)
    buckets = [int(b) // 4 for b in sizes.replace(",", " ").split()]
    times = allreduce_times(numel, buckets)
    if rank == 0:
        for label, (n, s) in times.items():
            print(f"gloo all-reduce, {label}: {n:,} floats ({4 * n / 2**20:.2f} MiB): median {1e3 * s:.2f} ms")
    mg.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
