"""One peer's training loop on the nano GPT (run on every rank by `torchrun`; used by train_peers.py).

    torchrun --standalone --nproc-per-node 2 benchmarks/_train_peer.py raw|fsdp2|accelerate|fabric OUT.json STEPS [k=v ...]

The same model, data, optimizer, schedule and batch as `multigpu train -f
nano`, written the way each library's docs write a loop. Each
step is timed from fetching the batch to the end of the optimizer step (what
multigpu's StepMeter times); rank 0 writes the steady-state tokens/s (steps
after the first 2) and the wall-clock time its first step ended.
"""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from multigpu.jobs.command import load_workload_config
from multigpu.jobs.registry import builtin
from multigpu.train.job import _context
from multigpu.train.optim import make_optimizer, make_scheduler

WARMUP = 2


def build(cfg):
    """The same data and model `multigpu train` builds from the config's factories."""
    data, _ = cfg.data.build("data.factory", _context(cfg))
    torch.manual_seed(cfg.seed)
    model = cfg.model.build("model.factory", _context(cfg, data.vocab_size))
    optimizer = make_optimizer(model, cfg)
    return data, model, optimizer, make_scheduler(optimizer, cfg)


def loss_of(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def batches(loader, set_epoch=None):
    epoch = 0
    while True:
        if set_epoch:
            set_epoch(epoch)
        yield from loader
        epoch += 1


def run_raw(cfg, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    data, model, opt, sched = _torch_group(cfg)
    return _torch_loop(cfg, steps, data, DDP(model), opt, sched)


def run_fsdp2(cfg, steps):
    """FSDP2 as torch's docs and torchtitan write it: ``fully_shard`` each transformer block, then the root; the
    optimizer over the sharded parameters; torch's own loop (no multigpu code past building the same model)."""
    from torch.distributed.fsdp import fully_shard

    data, model, _, _ = _torch_group(cfg)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = make_optimizer(model, cfg)  # after sharding: the optimizer holds the DTensor shards
    return _torch_loop(cfg, steps, data, model, opt, make_scheduler(opt, cfg))


def _torch_group(cfg):
    """A gloo group as torchrun's environment gives it, the thread budget, and the same data and model."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return build(cfg)


def _torch_loop(cfg, steps, data, model, opt, sched):
    """torch's own loop (raw DDP's and FSDP2's): a DistributedSampler's batches, backward, clip, step."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    sampler = DistributedSampler(data, seed=cfg.seed, drop_last=True)
    it = batches(DataLoader(data, batch_size=cfg.batch_size, sampler=sampler, drop_last=True), sampler.set_epoch)

    def step():
        x, y = next(it)
        loss = loss_of(model, x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    return timed(step, steps, dist.get_rank(), dist.get_world_size(), cfg)


def run_accelerate(cfg, steps):
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    acc = Accelerator(cpu=True)
    data, model, opt, sched = build(cfg)
    loader = DataLoader(data, batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    it = batches(loader)

    def step():
        x, y = next(it)
        loss = loss_of(model, x, y)
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    return timed(step, steps, acc.process_index, acc.num_processes, cfg)


def run_fabric(cfg, steps):
    # the standalone package (pip install lightning-fabric); in the full `lightning` package: lightning.fabric
    from lightning_fabric import Fabric
    from torch.utils.data import DataLoader

    fabric = Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ddp")
    fabric.launch()
    data, model, opt, sched = build(cfg)
    model, opt = fabric.setup(model, opt)
    it = batches(fabric.setup_dataloaders(DataLoader(data, batch_size=cfg.batch_size, shuffle=True, drop_last=True)))

    def step():
        x, y = next(it)
        loss = loss_of(model, x, y)
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()

    return timed(step, steps, fabric.global_rank, fabric.world_size, cfg)


def timed(step, steps, rank, world_size, cfg):
    times, first_step_at = [], None
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
        first_step_at = first_step_at or time.time()
    tokens = cfg.batch_size * cfg.block_size * world_size * (steps - WARMUP)
    return rank, {"throughput": tokens / sum(times[WARMUP:]), "first_step_at": first_step_at,
                  "world_size": world_size, "steps": steps}


def main(argv):
    which, out, steps, overrides = argv[0], argv[1], int(argv[2]), argv[3:]
    cfg = load_workload_config(builtin("train"), "nano", overrides)
    rank, result = {"raw": run_raw, "fsdp2": run_fsdp2, "accelerate": run_accelerate, "fabric": run_fabric}[which](cfg, steps)
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1:])
