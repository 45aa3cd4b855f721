"""PPO on CartPole: wall time to solve on 1 and 2 ranks for other shapes of the ppo-cartpole preset (a sweep).

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/rl_shapes.py --seeds 1 2 \\
        "num_envs=512" "num_envs=256 num_steps=32" "num_minibatches=4"

Each argument is one shape: overrides of ``multigpu rl -f ppo-cartpole`` (the empty string: the preset itself).
Each shape runs on 1 rank, then 2, per seed, the way benchmarks/rl_vs_cleanrl.py runs ours (one thread per rank,
mean return over the last 20 episodes >= 475); printed per shape: each run's wall to solve, the env-steps the
first rank count needed, the medians and 1 rank / 2 ranks. What it answers: which shapes solve sooner, and
whether 2 ranks then still pay (RESULTS.md, issue 51's targets).
"""

from __future__ import annotations

import argparse
import statistics

from rl_vs_cleanrl import ours


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shapes", nargs="*", default=[""], help='overrides, one shape per argument ("" = the preset)')
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    for shape in args.shapes:
        overrides = shape.split()
        walls: dict[int, list[float]] = {1: [], 2: []}
        steps = []
        for seed in args.seeds:
            for world in (1, 2):
                r = ours(world, seed, overrides)
                walls[world].append(r["wall_s"] if r["solved"] else float("inf"))
                if world == 1:
                    steps.append(r["env_steps"])
        one, two = statistics.median(walls[1]), statistics.median(walls[2])
        print(f"{shape or '(the preset)':<45} 1 rank {[round(w, 2) for w in walls[1]]} s, 2 ranks "
              f"{[round(w, 2) for w in walls[2]]} s, env-steps (1 rank) {steps}; medians {one:.2f} / {two:.2f} s, "
              f"1 rank / 2 ranks {one / two:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
