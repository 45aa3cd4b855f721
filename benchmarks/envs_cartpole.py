"""CartPole-v1 env-steps/s: ours against gymnasium and envpool, in the same run, one CPU thread each.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/envs_cartpole.py
    .venv/bin/python benchmarks/envs_cartpole.py --quick        # shorter runs, fewer sizes

Every contender steps the same pre-drawn random actions (16 batches, cycled),
after a warm-up, for at least ``--seconds`` per measurement. Autoreset is on
everywhere (next-step: gymnasium's default, ours, envpool's own). Reported:
env-steps/s on the wall clock and per CPU-second of this process (the second
is steadier on a shared machine), and each peer's ratio to ours at the same
size. "ours on N ranks" spawns N gloo ranks (one thread each) that step their
share of the same global batch; its rate is all ranks' steps / the slowest
rank's wall time. Missing peers are skipped with a message.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


def _measure(step, actions, seconds: float, num_envs: int) -> dict:
    for i in range(20):  # warm-up: allocator, caches
        step(actions[i % len(actions)])
    steps, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    while True:
        for _ in range(10):
            step(actions[steps % len(actions)])
            steps += 1
        wall = time.perf_counter() - wall0
        if wall >= seconds and steps >= 50:
            break
    cpu = time.process_time() - cpu0
    return {"wall": num_envs * steps / wall, "cpu": num_envs * steps / cpu}


def _random_actions(num_envs: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 2, num_envs) for _ in range(16)]


def ours(num_envs: int, seconds: float) -> dict:
    import multigpu as mg

    envs = mg.envs.make("CartPole-v1", num_envs=num_envs, seed=0)
    envs.reset()
    actions = [torch.from_numpy(a) for a in _random_actions(num_envs)]
    return _measure(envs.step, actions, seconds, num_envs)


def gymnasium_sync(num_envs: int, seconds: float) -> dict:
    import gymnasium as gym

    gym.logger.min_level = 40  # its float32-precision warnings say nothing about speed

    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
    envs.reset(seed=0)
    return _measure(envs.step, _random_actions(num_envs), seconds, num_envs)


def gymnasium_vector(num_envs: int, seconds: float) -> dict:
    import gymnasium as gym

    envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="vector_entry_point")
    envs.reset(seed=0)
    return _measure(envs.step, _random_actions(num_envs), seconds, num_envs)


def envpool_cartpole(num_envs: int, seconds: float) -> dict:
    import warnings

    import envpool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = envpool.make_gymnasium("CartPole-v1", num_envs=num_envs, num_threads=1, seed=0)
    envs.reset()
    actions = [a.astype(np.int32) for a in _random_actions(num_envs)]
    return _measure(envs.step, actions, seconds, num_envs)


def _rank_body(num_envs: int, seconds: float) -> dict:
    import multigpu as mg

    envs = mg.envs.make("CartPole-v1", num_envs=num_envs, seed=0, split=True)
    envs.reset()
    actions = [torch.from_numpy(a)[envs.env_ids] for a in _random_actions(num_envs)]
    for i in range(20):
        envs.step(actions[i % 16])
    mg.barrier()
    # a fixed step count on every rank (from rank 0's estimate), so the slowest rank sets the rate
    t = time.perf_counter()
    for i in range(20):
        envs.step(actions[i % 16])
    steps = mg.broadcast_object(max(50, int(seconds / ((time.perf_counter() - t) / 20))))
    mg.barrier()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        envs.step(actions[i % 16])
    return {"steps": steps * envs.num_envs, "wall": time.perf_counter() - wall0, "cpu": time.process_time() - cpu0}


def ours_on_ranks(num_envs: int, seconds: float, world_size: int) -> dict:
    from multigpu.testing import run_on_ranks

    parts = run_on_ranks(_rank_body, world_size, args=(num_envs, seconds), timeout_s=300, threads=1)
    steps = sum(p["steps"] for p in parts)
    return {"wall": steps / max(p["wall"] for p in parts), "cpu": steps / sum(p["cpu"] for p in parts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="minimum seconds per measurement")
    parser.add_argument("--quick", action="store_true", help="0.5 s per measurement")
    args = parser.parse_args()
    seconds = 0.5 if args.quick else args.seconds
    torch.set_num_threads(1)
    plan = [
        ("gymnasium SyncVectorEnv", gymnasium_sync, 64),
        ("envpool (1 thread)", envpool_cartpole, 64),
        ("gymnasium built-in vector", gymnasium_vector, 1024),
        ("envpool (1 thread)", envpool_cartpole, 1024),
        ("gymnasium built-in vector", gymnasium_vector, 16384),
    ]
    rows, ours_rate = [], {}
    for n in (64, 1024, 16384):
        ours_rate[n] = ours(n, seconds)
        rows.append(("multigpu.envs (ours)", n, ours_rate[n]))
    for name, fn, n in plan:
        try:
            rows.append((name, n, fn(n, seconds)))
        except ImportError as exc:
            print(f"skipped {name} at {n} envs: {exc} (pip install gymnasium envpool)")
    for world_size in (1, 2):
        rows.append((f"ours, split on {world_size} gloo rank(s)", 16384, ours_on_ranks(16384, seconds, world_size)))

    print(f"\nCartPole-v1 env-steps/s, one CPU thread per process (torch {torch.__version__})")
    print(f"{'contender':<34} {'envs':>6} {'wall M/s':>9} {'cpu M/s':>9} {'ours / it (wall)':>17} {'(cpu)':>7}")
    for name, n, rate in rows:
        mine = ours_rate[n]
        ratio = "" if name.startswith("multigpu") else f"{mine['wall'] / rate['wall']:>17.2f} {mine['cpu'] / rate['cpu']:>7.2f}"
        print(f"{name:<34} {n:>6} {rate['wall'] / 1e6:>9.3f} {rate['cpu'] / 1e6:>9.3f} {ratio}")


if __name__ == "__main__":
    main()
