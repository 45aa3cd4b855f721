"""Distributed PPO: wall time to solve (the preset's target_return over 100 episodes) on 1 vs 2 CPU ranks.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/envs_ppo_ranks.py --seeds 1 2 3
    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/envs_ppo_ranks.py --config ppo-pendulum
    .venv/bin/python benchmarks/envs_ppo_ranks.py --quick --json out.json     # what `make bench` runs

Runs ``multigpu rl -f ppo-cartpole --nproc-per-node W seed=S`` (or ``--config``) for
each seed, alternating 1 and 2 ranks (one thread per rank; the global
num_envs and every hyperparameter fixed), and reads each run's summary.json:
wall time from the first rollout to the solving update, updates, env-steps/s,
the communication share (DDP's timed all-reduce plus our collectives, which
includes waiting for the other rank) and each rank's busy (non-comm) time.
The load average is printed: on a shared machine other jobs take cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]


def run(world_size: int, seed: int, config: str, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="ppo_bench_") as tmp:
        cmd = [sys.executable, "-m", "multigpu", "rl", "-f", config, "--nproc-per-node", str(world_size),
               "--run-dir", tmp, f"seed={seed}", *overrides]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    rl = summary["rl"]
    return {"ranks": world_size, "seed": seed, "solved": rl["solved"], "updates": rl["updates"],
            "env_steps": rl["env_steps"], "wall_s": rl["wall_s"], "rate": summary["throughput"],
            "comm": summary["comm_share"], "busy": [round(r["busy_s"], 1) for r in summary["per_rank"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--config", default="ppo-cartpole")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run, e.g. num_envs=512")
    args = _record.add_flags(parser).parse_args()
    if args.quick:
        args.seeds = [1]
    world_sizes = (1, 2)
    if args.smoke:  # 1 rank, a few updates of a tiny batch: checks the script, not the speed (nothing is solved)
        args.seeds, args.overrides = [1], ["num_envs=16", "num_steps=8", "total_env_steps=256", *args.overrides]
        world_sizes = (1,)
    rows = []
    print(f"load average before: {os.getloadavg()[0]:.1f} (2 cores)", flush=True)
    for seed in args.seeds:
        for world_size in world_sizes:
            row = run(world_size, seed, args.config, args.overrides)
            rows.append(row)
            print(f"seed {seed} ranks {world_size}: {'solved' if row['solved'] else 'NOT solved'} after "
                  f"{row['updates']} updates / {row['env_steps']:,} env-steps in {row['wall_s']:.1f} s, "
                  f"{row['rate']:,.0f} env-steps/s, comm {row['comm']:.0%}, busy per rank {row['busy']} s",
                  flush=True)
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for world_size in world_sizes:
        mine = [r for r in rows if r["ranks"] == world_size]
        print(f"ranks {world_size}: median wall to solve {statistics.median(r['wall_s'] for r in mine):.1f} s, "
              f"median {statistics.median(r['rate'] for r in mine):,.0f} env-steps/s, "
              f"median updates {statistics.median(r['updates'] for r in mine):.0f}, "
              f"solved {sum(r['solved'] for r in mine)}/{len(mine)}")
    ratios = []
    if 2 in world_sizes:
        one = statistics.median(r["wall_s"] for r in rows if r["ranks"] == 1)
        two = statistics.median(r["wall_s"] for r in rows if r["ranks"] == 2)
        print(f"wall-time ratio 1 rank / 2 ranks (median): {one / two:.2f}")
    for seed in args.seeds if 2 in world_sizes else ():
        r1, r2 = (next(r for r in rows if r["seed"] == seed and r["ranks"] == w) for w in (1, 2))
        ratios.append(_record.ratio(f"wall to solve 1 rank / 2 ranks, seed {seed}", r1["wall_s"] / r2["wall_s"]))
        ratios.append(_record.ratio(f"env-steps/s 2 ranks / 1 rank, seed {seed}", r2["rate"] / r1["rate"]))
    _record.write(args, "envs_ppo_ranks", {"config": args.config, "seeds": args.seeds, "overrides": args.overrides},
                  [{**r, "busy": ", ".join(f"{b:.1f}" for b in r["busy"])} for r in rows], ratios)


if __name__ == "__main__":
    main()
