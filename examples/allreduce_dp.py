"""Data-parallel regression with an all-reduce per step, measured by StepMeter (runs inside each rank).

Each step every rank computes the gradient of a small MLP on its shard of a
fixed global batch (strong scaling; the run context's ``problem_scale`` grows it
under ``multigpu bench --weak``), all-reduces the gradient (that is the communication), and applies
the same SGD update, so every rank holds the same model.

    multigpu launch --nproc-per-node 2 examples/allreduce_dp.py
    multigpu bench --nproc 1,2 examples/allreduce_dp.py              # the scaling table
    multigpu bench --nproc 1,2 examples/allreduce_dp.py --hidden 2048  # more to communicate per step
"""

from __future__ import annotations

import argparse

import torch

import multigpu as mg
from multigpu.monitor import StepMeter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=2048, help="global batch per step (strong scaling)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()

    env = mg.init(seed=0)  # the same seed everywhere: identical initial model on every rank
    dev = mg.device()
    model = torch.nn.Sequential(torch.nn.Linear(args.dim, args.hidden), torch.nn.Tanh(),
                                torch.nn.Linear(args.hidden, 1)).to(dev)
    params = [p for p in model.parameters()]
    teacher = torch.randn(args.dim, 1, device=dev) / args.dim**0.5

    ctx = mg.run_context()  # what the launcher decided: run directory, scaling, --profile
    global_batch = args.batch * ctx.problem_scale(env.world_size)
    mine = mg.shard_range(global_batch)  # this rank's rows of every global batch
    lo, hi = mine.start, mine.stop
    gen = torch.Generator(device=dev).manual_seed(1234)  # data keyed by step, not by rank

    meter = StepMeter.from_context("samples", ctx, total_steps=args.steps, description="allreduce_dp", log_every=5)
    for _ in range(args.steps):
        x_all = torch.randn(global_batch, args.dim, generator=gen, device=dev)
        x = x_all[lo:hi]
        y = torch.sin(x @ teacher * 3)
        with meter.step(items=hi - lo):
            loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / global_batch
            grads = torch.autograd.grad(loss, params)
            # the communication; shapes are fixed by construction, so skip the shape check (a collective)
            flat = mg.all_reduce(torch.cat([g.reshape(-1) for g in grads]), "sum", check_shapes=False)
            with torch.no_grad():
                offset = 0
                for p in params:
                    p -= args.lr * flat[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
            meter.extras["loss"] = mg.all_reduce(loss.detach().reshape(1), "sum", check_shapes=False).item()
    summary = meter.close(extra={"final_loss": meter.extras["loss"]})
    if mg.is_main():
        print(f"allreduce_dp: {env.world_size} rank(s), {summary['throughput']:,.0f} samples/s, "
              f"comm {summary['comm_share']:.0%}, imbalance {summary['imbalance']:.2f}, "
              f"final loss {summary['final_loss']:.4f}", flush=True)
    mg.shutdown()


if __name__ == "__main__":
    main()
