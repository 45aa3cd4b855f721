"""PPO on CartPole-v1 on one GPU with the policy in the loop: training env-steps/s, and the time to solve.

    python benchmarks/gpu/ppo_gpu.py [--sizes 4096,65536,262144] [--updates 6] [--solve-envs 8192] [--solve-s 20]
    python benchmarks/gpu/ppo_gpu.py --quick          # small sizes on the CPU: seconds

Ours: ``multigpu.rl.train`` (what ``multigpu rl`` runs in each rank) on one GPU, the environments, the policy's
forward, its sampling, GAE and the PPO updates all on the device; one process, world size 1.

* **speed**: at each of ``--sizes`` environments, ``--updates`` updates of 16 steps each (4 epochs of 4
  minibatches, the ppo-cartpole preset's network and learning rate), after one untimed update at the first size
  (kernels, allocator). Training env-steps/s = env-steps / the wall time of the updates (``PPOResult``: first
  rollout to the end of the last update): rollouts with the policy in the loop and the learning both count,
  which is what PufferLib's published figure counts. ``envs_gpu.py`` times ``env.step`` alone.
* **solve**: the ppo-cartpole preset's settings (16 steps, 2 minibatches, 4 epochs, lr 2.5e-3) at
  ``--solve-envs`` environments until the mean return of the last 100 episodes reaches 475, or ``--solve-s``
  seconds: the wall seconds and env-steps to solve (CPU ranks here: 14-29 s at 1,024 environments).

Peer: PufferLib's published 4e6 training env-steps/s on CartPole with one RTX 5090: a published figure, not run
here (PufferLib is not installed on the GPU machine). Target: >= 4e6 training env-steps/s.
"""

from __future__ import annotations

import sys
import time

import _common
import torch

PUFFERLIB_ENV_STEPS_PER_S = 4e6
"""PufferLib's published training env-steps/s on CartPole, one RTX 5090 (the target; not run here)."""


class TimeLimit:
    """A run callback: end the run after the update during which ``seconds`` passed (``Run.stop``)."""

    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.perf_counter()

    def on_step(self, event) -> None:
        if time.perf_counter() - self.start >= self.seconds:
            event.run.stop("time limit")


def ppo(num_envs: int, *, updates: int | None = None, target: float | None = None, seconds: float = 60.0,
        num_minibatches: int = 4) -> dict:
    """One PPO run in this process: ``updates`` updates (speed) or until ``target`` (solve), at most ``seconds``."""
    from multigpu.rl import train
    from multigpu.rl.config import RLConfig

    steps = 16
    total = num_envs * steps * updates if updates else num_envs * steps * 100_000
    cfg = RLConfig(env_id="CartPole-v1", num_envs=num_envs, num_steps=steps, total_env_steps=total,
                   target_return=target, learning_rate=2.5e-3, num_minibatches=num_minibatches, update_epochs=4,
                   hidden_size=64, seed=1, log_every=10**9, checkpoint_every=0, callbacks=[TimeLimit(seconds)])
    result = train(cfg, log=lambda line: print(f"    {line}", flush=True))
    return {"num_envs": num_envs, "env_steps": result.env_steps, "wall_s": result.wall_s,
            "env_steps_per_s": result.env_steps / result.wall_s if result.wall_s > 0 else None,
            "solved": result.solved, "mean_return": result.mean_return, "episodes": result.episodes,
            "peak_memory_gib": _common.peak_memory_gib(torch.device(_device()))}


def _device() -> str:
    import multigpu as mg

    return str(mg.device())


def estimate(sizes: list[int], updates: int, solve_s: float) -> dict[str, float]:
    """Seconds on one H100: the start, an untimed update, each size's updates at 2e7 env-steps/s (five times the
    target; a size's first update pays its allocations), and the solve run's limit."""
    parts = {"start": _common.STARTUP_S, "warm-up update": 3.0}
    for n in sizes:
        parts[f"{n} envs"] = 1.0 + updates * n * 16 / 2e7
    parts["solve (its limit)"] = solve_s
    return parts


def main() -> int:
    p = _common.parser(__doc__)
    p.add_argument("--sizes", default="4096,65536,262144", help="numbers of environments for the speed runs")
    p.add_argument("--updates", type=int, default=6, help="timed updates per speed run")
    p.add_argument("--solve-envs", type=int, default=8192, help="environments of the run that solves CartPole")
    p.add_argument("--solve-s", type=float, default=20.0, help="time limit of the solve run, seconds")
    _common.add_estimate_flag(p)
    args = p.parse_args()
    try:
        sizes = [int(float(s)) for s in ("64,256" if args.quick else args.sizes).split(",")]
    except ValueError:
        print(f"error: --sizes {args.sizes!r} is not a list of numbers such as 4096,65536", file=sys.stderr)
        return 2
    updates, solve_envs, solve_s = (2, 256, 3.0) if args.quick else (args.updates, args.solve_envs, args.solve_s)
    if min(sizes) < 1 or updates < 1 or solve_envs < 1 or not solve_s > 0:
        print("error: --sizes, --updates, --solve-envs and --solve-s must be positive", file=sys.stderr)
        return 2
    if args.estimate:
        return _common.print_estimate(estimate(sizes, updates, solve_s))
    import multigpu as mg

    device = _common.pick_device("cpu" if args.quick and args.device == "auto" else args.device)
    mg.init(backend=device.type, threads=1 if device.type == "cpu" else None)
    print(f"PPO CartPole-v1 on {mg.device()}: speed at {sizes} envs x {updates} updates; solve at {solve_envs} envs "
          f"(at most {solve_s:g} s)", flush=True)
    ppo(sizes[0], updates=1, seconds=30.0)  # untimed: kernels, the allocator, the first rollout
    rows = []
    for n in sizes:
        r = ppo(n, updates=updates, seconds=30.0)
        rows.append({"run": "speed", **r})
        print(f"  {n:>9,} envs: {r['env_steps_per_s']:>14,.0f} training env-steps/s ({r['env_steps']:,} env-steps in "
              f"{r['wall_s']:.2f} s)", flush=True)
    solve = ppo(solve_envs, target=475.0, seconds=solve_s, num_minibatches=2)
    rows.append({"run": "solve", **solve})
    print(f"  solve at {solve_envs:,} envs: {'solved' if solve['solved'] else 'NOT solved'} in {solve['wall_s']:.1f} s, "
          f"{solve['env_steps']:,} env-steps, mean return {solve['mean_return']:.1f}", flush=True)
    mg.shutdown()
    best = max(r["env_steps_per_s"] or 0.0 for r in rows if r["run"] == "speed")
    summary = (f"{best:.3g} training env-steps/s at best; " +
               (f"solved in {solve['wall_s']:.1f} s ({solve['env_steps']:,} env-steps)" if solve["solved"] else
                f"not solved in {solve['wall_s']:.1f} s (mean return {solve['mean_return']:.0f})"))
    _common.write_record(args.json, {
        "benchmark": "ppo_gpu", "machine": _common.machine(),
        "config": {"env": "CartPole-v1", "sizes": sizes, "updates": updates, "num_steps": 16, "update_epochs": 4,
                   "solve_envs": solve_envs, "solve_s": solve_s, "device": str(device)},
        "ours": rows, "summary": summary,
        "peer": {"name": "PufferLib, CartPole, one RTX 5090 (published figure, not run here)",
                 "env_steps_per_s": PUFFERLIB_ENV_STEPS_PER_S},
        "ratio": best / PUFFERLIB_ENV_STEPS_PER_S,
        "targets": {"training env-steps/s >= 4e6": best >= PUFFERLIB_ENV_STEPS_PER_S,
                    "solves CartPole-v1 (mean return 475)": solve["solved"]},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
