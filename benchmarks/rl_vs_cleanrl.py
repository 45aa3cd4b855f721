"""PPO to solve CartPole-v1 (mean return >= 475 over the last 20 episodes): ours on 1 and 2 ranks vs CleanRL's ppo.py.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/rl_vs_cleanrl.py --seeds 1 2 3
    .venv/bin/python benchmarks/rl_vs_cleanrl.py --quick --json out.json     # what `make bench` runs (seeds 1, 2)

Per seed, one after the other: ours, ``multigpu rl -f ppo-cartpole --nproc-per-node {1,2} seed=S
return_window=20`` (one thread per rank; every other hyperparameter the preset's, the same on both world sizes),
then CleanRL's ``ppo.py`` (benchmarks/peers/cleanrl/, vendored unchanged; its defaults: 4 gymnasium CartPole-v1
environments in a SyncVectorEnv, 128 steps, lr 2.5e-4, 500,000 steps; ``--seed S``; one thread), stopped when
the mean of its last 20 episodes reaches 475 (benchmarks/_cleanrl_peer.py) or at its own total steps.
Wall to solve: first rollout (CleanRL: first reset) to the solving update (step); "process" is the whole
command, start-up included. env-steps/s = env-steps to solve / wall to solve. Targets (issue 51): ours 2 ranks
>= 1.6x faster than 1 rank, ours >= 10x faster than CleanRL, in wall time to solve.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]
WINDOW, TARGET = 20, 475.0
CLEANRL_COMMIT = "fe8d8a03c41a7ef5b523e2e354bd01c363e786bb"


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def ours(world_size: int, seed: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="rl_bench_") as tmp:
        cmd = [sys.executable, "-m", "multigpu", "rl", "-f", "ppo-cartpole", "--nproc-per-node", str(world_size),
               "--run-dir", tmp, f"seed={seed}", f"return_window={WINDOW}", f"target_return={TARGET}", *overrides]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env())
        process_s = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        rl = json.loads((Path(tmp) / "summary.json").read_text())["rl"]
    return {"contender": f"ours, {world_size} rank{'s' if world_size > 1 else ''}", "seed": seed,
            "solved": rl["solved"], "wall_s": rl["wall_s"], "process_s": process_s, "env_steps": rl["env_steps"],
            "env-steps/s": rl["env_steps"] / rl["wall_s"], "mean_return": rl["mean_return"]}


def cleanrl(seed: int, ppo_args: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="cleanrl_bench_") as tmp:  # ppo.py writes runs/ (TensorBoard) here
        cmd = [sys.executable, str(ROOT / "benchmarks" / "_cleanrl_peer.py"), "--target", str(TARGET),
               "--window", str(WINDOW), "--", "--seed", str(seed), *ppo_args]
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=1200, env=_env())
        process_s = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"contender": "CleanRL ppo.py", "seed": seed, "solved": got["solved"], "wall_s": got["wall_s"],
            "process_s": process_s, "env_steps": got["env_steps"], "env-steps/s": got["env_steps"] / got["wall_s"],
            "mean_return": got["mean_return"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    args = _record.add_flags(parser).parse_args()
    world_sizes, overrides, ppo_args = (1, 2), [], []
    if args.quick:  # two rounds: one seed's wall to solve swings by 1.1-1.7x between quiet runs
        args.seeds = [1, 2]
    if args.smoke:  # a few updates of tiny batches: checks the script, not the speed (nothing is solved)
        args.seeds, world_sizes = [1], (1,)
        overrides = ["num_envs=16", "num_steps=8", "total_env_steps=256"]
        ppo_args = ["--total-timesteps", "1024"]
    print(f"load average before: {os.getloadavg()[0]:.1f} ({os.cpu_count()} cores)", flush=True)
    rows, ratios, notes = [], [], []
    for round_, seed in enumerate(args.seeds, 1):
        mine = [ours(w, seed, overrides) for w in world_sizes]
        peer = cleanrl(seed, ppo_args)
        for row in (*mine, peer):
            rows.append({"round": round_, **row})
            print(f"seed {seed} {row['contender']}: {'solved' if row['solved'] else 'NOT solved'} in "
                  f"{row['wall_s']:.1f} s ({row['process_s']:.1f} s in all) after {row['env_steps']:,} env-steps, "
                  f"{row['env-steps/s']:,.0f} env-steps/s", flush=True)
        last = mine[-1]
        if len(mine) == 2:
            ratios.append(_record.ratio("wall to solve: ours 1 rank / ours 2 ranks",
                                        mine[0]["wall_s"] / mine[1]["wall_s"], round_))
            ratios.append(_record.ratio("env-steps/s: ours 2 ranks / ours 1 rank",
                                        mine[1]["env-steps/s"] / mine[0]["env-steps/s"], round_))
        for row in mine:
            ratios.append(_record.ratio(f"wall to solve: CleanRL / {row['contender']}",
                                        peer["wall_s"] / row["wall_s"], round_))
        ratios.append(_record.ratio(f"env-steps/s: {last['contender']} / CleanRL",
                                    last["env-steps/s"] / peer["env-steps/s"], round_))
        if not peer["solved"]:
            notes.append(f"seed {seed}: CleanRL did not reach {TARGET:g} within its steps: its wall is a lower "
                         "bound, and so is ours / CleanRL")
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    for name in dict.fromkeys(r["name"] for r in ratios):
        values = [r["value"] for r in ratios if r["name"] == name]
        print(f"{name}: {', '.join(f'{v:.2f}' for v in values)} (median {statistics.median(values):.2f})")
    if not args.smoke:
        scaling = [r["value"] for r in ratios if r["name"] == "wall to solve: ours 1 rank / ours 2 ranks"]
        peer_ratio = [r["value"] for r in ratios if r["name"] == "wall to solve: CleanRL / ours, 2 ranks"]
        unsolved = [r["seed"] for r in rows if not r["solved"]]
        notes.append(f"target 2 ranks >= 1.6x 1 rank: {'met' if min(scaling) >= 1.6 else 'NOT met'} "
                     f"({', '.join(f'{v:.2f}' for v in scaling)})")
        notes.append(f"target ours >= 10x CleanRL: {'met' if min(peer_ratio) >= 10 else 'NOT met'} "
                     f"({', '.join(f'{v:.1f}' for v in peer_ratio)})")
        if unsolved:
            notes.append(f"not solved: seeds {sorted(set(unsolved))} (see rows)")
    for note in notes:
        print(note)
    _record.write(args, "rl_vs_cleanrl", {"seeds": args.seeds, "window": WINDOW, "target": TARGET,
                                          "overrides": overrides, "cleanrl_args": ppo_args,
                                          "cleanrl_commit": CLEANRL_COMMIT}, rows, ratios, notes)


if __name__ == "__main__":
    main()
