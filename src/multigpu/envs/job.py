"""The ``envs`` workload: step batched environments split over ranks and measure env-steps/s (both sides).

    multigpu bench --nproc 1,2 envs                       # CartPole-v1, 16,384 environments in all
    multigpu bench --nproc 1,2 envs env_id=Pendulum-v1 num_envs=65536 steps=100
    multigpu run envs num_envs=4096 --nproc-per-node 2    # once, without the scaling table

``num_envs`` is global (times world_size under ``multigpu bench --weak``); each
rank steps its share with pre-drawn random actions, and the step meter reduces
the rate over ranks (``summary.json`` in the run directory).
"""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.errors import ConfigError
from multigpu.jobs.workload import Workload
from multigpu.runtime.context import RunContext

__all__ = ["WORKLOAD", "EnvsBenchConfig", "main"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvsBenchConfig:
    env_id: str = "CartPole-v1"
    """An environment of ``multigpu.envs`` (CartPole-v1, Pendulum-v1)."""
    num_envs: int = 16384
    """Environments in the whole job."""
    steps: int = 300
    """Steps measured (after 5 warm-up steps)."""
    seed: int = 0
    threads: int = 1
    """CPU threads per rank: at these sizes each op is too short for OpenMP to pay, and 2 threads per rank
    measured 35x slower on a busy 2-core machine (benchmarks/history/environments.md)."""

    def __post_init__(self) -> None:
        for name in ("num_envs", "steps", "threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"envs.{name}={getattr(self, name)} is invalid; valid: a whole number >= 1")
        from multigpu.envs import registered_ids

        if self.env_id not in registered_ids():
            raise ConfigError(f"envs.env_id {self.env_id!r} is not known; valid: {', '.join(sorted(registered_ids()))}")


def main(cfg: EnvsBenchConfig, ctx: RunContext) -> int:
    import torch

    import multigpu as mg
    from multigpu.run import Run

    num_envs = cfg.num_envs * ctx.problem_scale(mg.world_size())
    envs = mg.envs.make(cfg.env_id, num_envs=num_envs, seed=cfg.seed, split=True)
    envs.reset()
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + mg.rank())
    space = envs.single_action_space
    if hasattr(space, "n"):
        actions = [torch.randint(0, int(space.n), (envs.num_envs,), generator=gen) for _ in range(16)]
    else:
        low, high = float(space.low.min()), float(space.high.max())
        actions = [low + (high - low) * torch.rand(envs.num_envs, *space.shape, generator=gen) for _ in range(16)]
    actions = [a.to(envs.device) for a in actions]
    from multigpu.units import shown

    # the run harness times every step (its meter: the run's folder, sampler, --profile) and writes summary.json;
    # nothing here is checkpointed
    run = Run(ctx, total=cfg.steps + 5, checkpoint_last=False, unit="env-steps",
              description=f"{cfg.env_id} x{num_envs:,}", warmup_steps=5)
    for step in run.steps():
        run.add_items(envs.num_envs)
        envs.step(actions[step % len(actions)])
    step_path = getattr(envs, "cpu_step", "torch step") if envs.device.type == "cpu" else "torch step"
    summary = run.close({"envs": {"env_id": cfg.env_id, "num_envs": num_envs, "step": step_path}})
    if mg.is_main():
        limit = getattr(envs, "host_step_max_envs", 0)  # a factory's environment has no host step
        crossover = "" if envs.device.type != "cpu" else (
            f"; host step up to {limit:,} envs per rank, torch above" if 0 < limit < float("inf")
            else "; host step at every size" if limit else "")
        print(f"{cfg.env_id}: {num_envs:,} envs on {summary['world_size']} rank(s) ({envs.device.type}: "
              f"{step_path}{crossover}): {summary['throughput']:,.0f} env-steps/s, "
              f"comm share {shown(summary['comm_share'], '.1%')}", flush=True)
    return 0


WORKLOAD = Workload(
    name="envs",
    config=EnvsBenchConfig,
    main=main,
    init=lambda cfg: {"threads": cfg.threads},
    help="CartPole-v1 env-steps/s, 16,384 envs split over the ranks; add key=value overrides (num_envs=..., env_id=...)",
    prefix="envs",
    command=False,
)
