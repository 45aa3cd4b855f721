"""The ``rl`` workload: distributed PPO on batched environments split across ranks (both sides).

    multigpu rl -f ppo-cartpole --nproc-per-node 2          # 2 CPU ranks where there is no GPU
    multigpu rl -f ppo-cartpole --gpus all num_envs=4096 seed=3
    multigpu rl -f ppo-pendulum --nproc-per-node 2          # continuous actions: a Gaussian policy
    multigpu rl --env mypkg.envs:make_env env.kwargs.size=5 obs_norm=true   # your own batched environment

The config (:class:`~multigpu.rl.RLConfig`) checks itself, a registered
environment id included, when it is loaded; ``check`` (in the launcher) imports
an ``--env`` factory, checks its keyword arguments, builds one environment on
the CPU to read its spaces (a Discrete or Box action space) and checks that
every rank's minibatches hold at least two samples. ``main`` trains on every
rank (:func:`multigpu.rl.train`) and rank 0 writes ``summary.json`` into the run directory, and
checkpoints there (``--resume auto`` continues one; :func:`multigpu.rl.load_policy` reads the policy back).
"""

from __future__ import annotations

import dataclasses

from multigpu.errors import ConfigError
from multigpu.jobs.workload import Flag, JobPlan, Workload
from multigpu.rl.config import RLConfig
from multigpu.runtime.context import RunContext

__all__ = ["WORKLOAD", "check", "main"]


def check(cfg: RLConfig, plan: JobPlan) -> None:
    """In the launcher: the environment factory and the split of the rollout over ``plan.world_size`` ranks."""
    from multigpu.envs import make
    from multigpu.envs.adapter import FACTORY_ARGUMENTS, autoreset_mode_of
    from multigpu.rl.policy import policy_for

    mode = "same_step"
    if cfg.env is not None:
        cfg.env.check("env.factory", dict.fromkeys(FACTORY_ARGUMENTS))  # filled in by the adapter, per rank
        envs = make(cfg.env.factory, 1, seed=0, device="cpu", autoreset_mode="same_step", kwargs=cfg.env.kwargs)
        try:
            mode = autoreset_mode_of(envs)
            if mode not in ("same_step", "next_step"):
                raise ConfigError(f"env.factory {cfg.env.factory!r} builds environments with autoreset_mode {mode!r}; "
                                  "valid: same_step, next_step (or disabled, when the factory takes autoreset_mode)")
            policy_for(envs.single_observation_space, envs.single_action_space, action_bounds=cfg.action_bounds,
                       what=f"env.factory {cfg.env.factory!r}")
        finally:
            getattr(envs, "close", lambda: None)()
    num_envs = cfg.num_envs * plan.ctx.problem_scale(plan.world_size)
    if num_envs < plan.world_size:
        raise ConfigError(f"rl.num_envs={num_envs} leaves a rank without environments; valid: num_envs >= "
                          f"{plan.world_size} (the world size)")
    # next-step autoreset wastes up to half the steps (the reset steps are dropped from the batch)
    need = (2 if mode == "same_step" else 4) * cfg.num_minibatches
    smallest = num_envs // plan.world_size * cfg.num_steps
    if smallest < need:
        raise ConfigError(f"rl: the smallest rank's rollout ({num_envs // plan.world_size} envs x {cfg.num_steps} "
                          f"steps = {smallest}) is too small for num_minibatches={cfg.num_minibatches} "
                          f"(at least {need}{'' if mode == 'same_step' else ' with next-step autoreset'}); "
                          "raise num_envs or num_steps, or lower num_minibatches")


def main(cfg: RLConfig, ctx: RunContext) -> int:
    import multigpu as mg
    from multigpu.rl.ppo import train

    cfg = dataclasses.replace(cfg, num_envs=cfg.num_envs * ctx.problem_scale(mg.world_size()))
    if mg.is_main():
        print(f"multigpu rl: {cfg.env_name}, {cfg.num_envs} envs in all, run dir {ctx.run_dir}", flush=True)
    result = train(cfg, ctx, log=lambda line: print(line, flush=True))
    return 128 + result.interrupted if result.interrupted else 0  # as a process ended by that signal: 130, 143


WORKLOAD = Workload(
    name="rl",
    config=RLConfig,
    check=check,
    main=main,
    init=lambda cfg: {"seed": cfg.seed, "threads": cfg.threads},
    help="train a policy with PPO on environments split across ranks (DDP)",
    prefix="rl",
    flags=(
        Flag("--env", "env.factory", metavar="PKG.MODULE:FACTORY",
             help="your batched environment's factory (env.kwargs.NAME=... for its arguments; default: env_id)"),
        Flag("--obs-norm", "obs_norm", action="store_true", help="normalize observations (running mean/var, all ranks)"),
        Flag("--checkpoint-mode", "checkpoint_mode", choices=["async", "sync"],
             help="async: write checkpoints in the background (the default); sync: wait until each is on disk"),
        Flag("--checkpoint-on-interrupt", "checkpoint_on_interrupt", action="store_true",
             help="on Ctrl-C or SIGTERM, finish the current update and write a checkpoint before stopping"),
    ),
    bench=("total_env_steps=20000", "target_return=null", "checkpoint_every=0"),
    resumable=True,
    resume_total=lambda cfg: max(1, cfg.total_env_steps // (cfg.num_envs * cfg.num_steps)),  # updates (rl.ppo)
    preload=("torch._dynamo",),  # its optimizer imports it when made
    resume_keeps=("env_id", "env", "num_envs", "num_steps", "num_minibatches", "seed", "hidden_size",
                  "action_bounds", "log_std_init", "obs_norm", "return_window"),
)
