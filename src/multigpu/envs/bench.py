"""Step batched environments split over ranks and measure env-steps/s (runs inside each rank).

    multigpu launch --nproc-per-node 2 -m multigpu.envs.bench --num-envs 16384 --steps 300
    multigpu bench --nproc 1,2 envs                      # the same, as a built-in bench workload

``--num-envs`` is global (times world_size under ``multigpu bench --weak``);
each rank steps its share with pre-drawn random actions, and the step meter
reduces the rate over ranks (``summary.json`` in the run directory when one is set).
"""

from __future__ import annotations

import argparse
import sys

import torch

import multigpu as mg
from multigpu.monitor import StepMeter, problem_scale


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m multigpu.envs.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="CartPole-v1", help="environment id (default CartPole-v1)")
    parser.add_argument("--num-envs", type=int, default=16384, help="environments in the whole job")
    parser.add_argument("--steps", type=int, default=300, help="steps to measure (after 5 warm-up steps)")
    parser.add_argument("--seed", type=int, default=0)
    # one thread by default: at these sizes each op is too short for OpenMP to pay, and 2 threads per rank
    # measured 35x slower on a busy 2-core machine (benchmarks/RESULTS.md)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per rank (default 1)")
    args = parser.parse_args(argv)
    mg.init(threads=args.threads)
    num_envs = args.num_envs * problem_scale()
    envs = mg.envs.make(args.env, num_envs=num_envs, seed=args.seed, split=True)
    envs.reset()
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + mg.rank())
    space = envs.single_action_space
    if hasattr(space, "n"):
        actions = [torch.randint(0, int(space.n), (envs.num_envs,), generator=gen) for _ in range(16)]
    else:
        low, high = float(space.low.min()), float(space.high.max())
        actions = [low + (high - low) * torch.rand(envs.num_envs, *space.shape, generator=gen) for _ in range(16)]
    actions = [a.to(envs.device) for a in actions]
    meter = StepMeter("env-steps", total_steps=args.steps + 5, description=f"{args.env} x{num_envs:,}", warmup_steps=5)
    for step in range(args.steps + 5):
        with meter.step(items=envs.num_envs):
            envs.step(actions[step % len(actions)])
    summary = meter.close({"envs": {"env_id": args.env, "num_envs": num_envs}})
    if mg.is_main():
        print(f"{args.env}: {num_envs:,} envs on {summary['world_size']} rank(s) ({envs.device.type}): "
              f"{summary['throughput']:,.0f} env-steps/s, comm share {summary['comm_share']:.1%}", flush=True)
    mg.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
