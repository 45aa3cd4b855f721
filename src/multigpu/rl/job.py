"""The ``rl`` workload: distributed PPO on batched environments split across ranks (both sides).

    multigpu rl -f ppo-cartpole --nproc-per-node 2          # 2 CPU ranks where there is no GPU
    multigpu rl -f ppo-cartpole --gpus all num_envs=4096 seed=3

The config (:class:`~multigpu.rl.RLConfig`) checks itself, environment id
included, when it is loaded in the launcher; ``main`` trains on every rank
(:func:`multigpu.rl.train`) and rank 0 writes ``summary.json`` into the run directory.
"""

from __future__ import annotations

import dataclasses

from multigpu.jobs.workload import Workload
from multigpu.rl.config import RLConfig
from multigpu.runtime.context import RunContext

__all__ = ["WORKLOAD", "main"]


def main(cfg: RLConfig, ctx: RunContext) -> int:
    import multigpu as mg
    from multigpu.rl.ppo import train

    cfg = dataclasses.replace(cfg, num_envs=cfg.num_envs * ctx.problem_scale(mg.world_size()))
    if mg.is_main():
        print(f"multigpu rl: {cfg.env_id}, {cfg.num_envs} envs in all, run dir {ctx.run_dir}", flush=True)
    train(cfg, run_dir=ctx.run_dir, log=lambda line: print(line, flush=True))
    return 0


WORKLOAD = Workload(
    name="rl",
    config=RLConfig,
    main=main,
    init=lambda cfg: {"seed": cfg.seed, "threads": cfg.threads},
    help="train a policy with PPO on environments split across ranks (DDP)",
    prefix="rl",
    bench=("total_env_steps=20000", "target_return=null"),
)
