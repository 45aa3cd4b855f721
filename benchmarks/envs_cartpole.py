"""CartPole-v1 and Pendulum-v1 env-steps/s: ours against gymnasium's vector envs, in the same run, one CPU thread.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/envs_cartpole.py
    .venv/bin/python benchmarks/envs_cartpole.py --quick --json out.json   # short runs (make bench)

Side by side, per environment and size (64 ... 65,536 environments): ours
(``mg.envs.make``) and gymnasium's own vector environment are built in this
process, both warmed up alike (a thrown-away round), and measured in rounds of
at least ``--seconds`` per side; inside a round the two alternate in
``--slices`` slices each (ours, peer, ours, peer, ...), every slice at least
20 steps, and a side's rate is its best slice (timeit's minimum, the same for
both), so a burst of load from another process costs a slice, not a side's
round. Every round's ratio (ours / peer env-steps/s) is printed, on the wall
clock and per CPU-second of this process (the second is steadier on a shared
machine), not only the best; the JSON also keeps each side's mean over all
its slices. Peers: CartPole-v1's
``gymnasium.make_vec(..., vectorization_mode="vector_entry_point")``
(``CartPoleVectorEnv``, NumPy over the whole batch); Pendulum-v1 has no vector
entry point in gymnasium, so ``make_vec`` gives a ``SyncVectorEnv`` (one
Python environment per slot). Both step the same pre-drawn random actions (16
batches, cycled) with next-step autoreset, after a warm-up.

CartPole-v1 also runs EnvPool's C++ pool with one thread as a third side of every round, where envpool
is installed (a ``peers`` extra; ours / envpool is recorded beside the target ratio). Without ``--quick``
a second table adds one-round figures for gymnasium's SyncVectorEnv CartPole, envpool and ours split
over 1 and 2 gloo ranks. ``--json PATH`` writes every round as JSON (machine-readable, for
``make bench``). Targets: ours >= 1.0x the peer at every size in every round, >= 1.2x at 64
and >= 3x at 16,384 environments.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time

import _record
import numpy as np
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

SIZES = (64, 256, 1024, 4096, 16384, 65536)
QUICK_SIZES = (64, 1024, 16384)  # --quick: the sizes of the targets, and one between (make bench: < 10 minutes)
ENV_IDS = ("CartPole-v1", "Pendulum-v1")
QUICK_PEER_LIMIT = {"Pendulum-v1": 1024}  # --quick: gymnasium's SyncVectorEnv takes ~1 ms per environment to build
TARGETS = {64: 1.2, 16384: 3.0}  # ours / gymnasium in every round; 1.0 elsewhere
SLICES = 5  # alternating slices per side in a round; a side's rate is its best slice
WARMUP_S = 1.0  # at most this long, a thrown-away round of the same shape before round 1
QUICK_S = 1.0  # --quick: seconds per side per round (0.25 s let one lucky 50 ms slice decide a round)


def _measure(step, actions, seconds: float, num_envs: int, min_steps: int = 20) -> dict:
    steps, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    while True:
        step(actions[steps % len(actions)])
        steps += 1
        wall = time.perf_counter() - wall0
        if wall >= seconds and steps >= min_steps:
            break
    cpu = time.process_time() - cpu0
    return {"steps": steps, "wall_s": wall, "cpu_s": cpu, "wall": num_envs * steps / wall, "cpu": num_envs * steps / cpu}


def _random_actions(env_id: str, num_envs: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    if env_id == "CartPole-v1":
        return [rng.integers(0, 2, num_envs) for _ in range(16)]
    return [(rng.random((num_envs, 1)) * 4 - 2).astype(np.float32) for _ in range(16)]


def _ours(env_id: str, num_envs: int):
    import multigpu as mg

    envs = mg.envs.make(env_id, num_envs=num_envs, seed=0)
    envs.reset()
    return envs.step, [torch.from_numpy(a) for a in _random_actions(env_id, num_envs)]


def _gymnasium(env_id: str, num_envs: int):
    import gymnasium as gym

    gym.logger.min_level = 40  # its float32-precision warnings say nothing about speed
    mode = "vector_entry_point" if env_id == "CartPole-v1" else "sync"  # Pendulum-v1 has no vector entry point
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode)
    envs.reset(seed=0)
    return envs.step, _random_actions(env_id, num_envs)


def gymnasium_vector(num_envs: int, seconds: float, env_id: str = "CartPole-v1") -> dict:
    """gymnasium's vector env alone for ``seconds`` (benchmarks/gpu/envs_gpu.py runs one per CPU core)."""
    step, actions = _gymnasium(env_id, num_envs)
    return _measure(step, actions, seconds, num_envs)


def _peer_name(env_id: str) -> str:
    return "gymnasium CartPoleVectorEnv" if env_id == "CartPole-v1" else "gymnasium SyncVectorEnv (make_vec)"


def _best_of_slices(num_envs: int, slices: list[dict]) -> dict:
    """One side's figures from its slices of a round: the best slice's rates (timeit's min), and the totals."""
    best_wall = max(slices, key=lambda s: s["wall"])
    best_cpu = max(slices, key=lambda s: s["cpu"])
    steps, wall_s, cpu_s = (sum(s[k] for s in slices) for k in ("steps", "wall_s", "cpu_s"))
    return {"steps": steps, "wall_s": wall_s, "cpu_s": cpu_s, "wall": best_wall["wall"], "cpu": best_cpu["cpu"],
            "wall_mean": num_envs * steps / wall_s, "cpu_mean": num_envs * steps / cpu_s,
            "wall_slices": [s["wall"] for s in slices]}


def _round(sides, seconds: float, num_envs: int, slices: int) -> list[dict]:
    """One round: ``slices`` alternating slices per side (ours, peer, ours, peer, ...), each >= seconds / slices.

    Both sides get the same treatment: the same slice length, a step floor that
    covers timer resolution, and the best slice as the side's rate, so a burst
    of load from another process costs one slice rather than one side's whole round.
    """
    parts: list[list[dict]] = [[] for _ in sides]
    for _ in range(slices):
        for i, (step, actions, min_steps) in enumerate(sides):
            parts[i].append(_measure(step, actions, seconds / slices, num_envs, min_steps=min_steps))
    return [_best_of_slices(num_envs, p) for p in parts]


def _envpool(env_id: str, num_envs: int):
    """EnvPool's C++ pool with one thread, or None where envpool is not installed (or not for this env)."""
    if env_id != "CartPole-v1" or importlib.util.find_spec("envpool") is None:
        return None
    import warnings

    import envpool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = envpool.make_gymnasium(env_id, num_envs=num_envs, num_threads=1, seed=0)
    envs.reset()
    return envs.step, [a.astype(np.int32) for a in _random_actions(env_id, num_envs)]


def side_by_side(env_id: str, num_envs: int, seconds: float, rounds: int, slices: int = SLICES) -> dict:
    """Alternating rounds of ours, gymnasium's vector env and (CartPole, where installed) EnvPool with one thread
    at one size (all warmed up first, alike)."""
    ours_step, ours_actions = _ours(env_id, num_envs)
    peer_step, peer_actions = _gymnasium(env_id, num_envs)
    peer_min = 20 if num_envs * (1 if env_id == "CartPole-v1" else 100) <= 100_000 else 2  # SyncVectorEnv: ~10 us/env
    sides = [(ours_step, ours_actions, 20), (peer_step, peer_actions, peer_min)]
    pool = _envpool(env_id, num_envs)
    if pool is not None:
        sides.append((*pool, 20))
    # warm-up: a round of the same shape, thrown away: allocator, caches, lazy imports and
    # drawn-ahead states on both sides before the first measured round
    _round(sides, min(seconds, WARMUP_S), num_envs, slices)
    out = []
    for _ in range(rounds):
        ours, peer, *pool_side = _round(sides, seconds, num_envs, slices)
        out.append({"ours": ours, "peer": peer, "ratio_wall": ours["wall"] / peer["wall"],
                    "ratio_cpu": ours["cpu"] / peer["cpu"], "ratio_wall_mean": ours["wall_mean"] / peer["wall_mean"],
                    **({"envpool": pool_side[0], "ratio_envpool_wall": ours["wall"] / pool_side[0]["wall"]}
                       if pool_side else {})})
    target = TARGETS.get(num_envs, 1.0)
    ratios = [r["ratio_wall"] for r in out]
    return {
        "env_id": env_id, "num_envs": num_envs, "peer": _peer_name(env_id), "rounds": out, "target": target,
        "slices": slices, "ratio_wall_min": min(ratios), "ratio_wall_median": statistics.median(ratios),
        "ratio_cpu_min": min(r["ratio_cpu"] for r in out),
        "met_every_round_wall": all(x >= target for x in ratios),
        "met_every_round_cpu": all(r["ratio_cpu"] >= target for r in out),
    }


# -- the one-round extras (full mode) --------------------------------------------------------------------


def gymnasium_sync(num_envs: int, seconds: float) -> dict:
    import gymnasium as gym

    gym.logger.min_level = 40
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
    envs.reset(seed=0)
    return _measure(envs.step, _random_actions("CartPole-v1", num_envs), seconds, num_envs)


def envpool_cartpole(num_envs: int, seconds: float) -> dict:
    import warnings

    import envpool

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        envs = envpool.make_gymnasium("CartPole-v1", num_envs=num_envs, num_threads=1, seed=0)
    envs.reset()
    actions = [a.astype(np.int32) for a in _random_actions("CartPole-v1", num_envs)]
    return _measure(envs.step, actions, seconds, num_envs)


def _rank_body(num_envs: int, seconds: float) -> dict:
    import multigpu as mg

    envs = mg.envs.make("CartPole-v1", num_envs=num_envs, seed=0, split=True)
    envs.reset()
    actions = [torch.from_numpy(a)[envs.env_ids] for a in _random_actions("CartPole-v1", num_envs)]
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


def extras(seconds: float) -> list[tuple[str, int, dict]]:
    rows = []
    for n in (64, 1024, 16384):
        step, actions = _ours("CartPole-v1", n)
        _measure(step, actions, 0.0, n)
        rows.append(("multigpu.envs (ours)", n, _measure(step, actions, seconds, n)))
    for name, fn, n in [("gymnasium SyncVectorEnv", gymnasium_sync, 64), ("envpool (1 thread)", envpool_cartpole, 64),
                        ("envpool (1 thread)", envpool_cartpole, 1024)]:
        try:
            rows.append((name, n, fn(n, seconds)))
        except ImportError as exc:
            print(f"skipped {name} at {n} envs: {exc} (pip install gymnasium envpool)")
    for world_size in (1, 2):
        rows.append((f"ours, split on {world_size} gloo rank(s)", 16384, ours_on_ranks(16384, seconds, world_size)))
    return rows


# -- output ----------------------------------------------------------------------------------------------


def _print_side_by_side(result: dict) -> None:
    cells = "  ".join(f"{r['ratio_wall']:.2f} ({r['ratio_cpu']:.2f})" for r in result["rounds"])
    if "envpool" in result["rounds"][0]:
        cells += "   vs envpool: " + "  ".join(f"{r['ratio_envpool_wall']:.2f}" for r in result["rounds"])
    ours = statistics.median(r["ours"]["wall"] for r in result["rounds"])
    peer = statistics.median(r["peer"]["wall"] for r in result["rounds"])
    verdict = "ok" if result["met_every_round_wall"] else f"BELOW {result['target']:.1f}x"
    print(f"{result['env_id']:<12} {result['num_envs']:>6} {ours / 1e6:>9.3f} {peer / 1e6:>9.3f}   {cells}   {verdict}",
          flush=True)


def _parse_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid; give whole numbers >= 1 separated by commas, "
                                         "e.g. 64,1024")
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="minimum seconds per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per size (default 3)")
    parser.add_argument("--sizes", type=_parse_sizes, default=None, help="comma-separated environment counts "
                        f"(default {','.join(map(str, SIZES))}; --quick: {','.join(map(str, QUICK_SIZES))})")
    parser.add_argument("--slices", type=int, default=SLICES, help="alternating slices per side in a round "
                        f"(default {SLICES}); a side's rate is its best slice")
    parser.add_argument("--envs", default=",".join(ENV_IDS), help=f"comma-separated, of {', '.join(ENV_IDS)}")
    args = _record.add_flags(parser).parse_args()  # --quick: QUICK_S per side per round, no extras; --smoke; --json
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else SIZES
    if args.smoke:  # the test suite's size: every code path once, figures meaningless
        args.sizes, args.rounds, args.seconds = (64,), 1, 0.02
    env_ids = args.envs.split(",")
    if any(e not in ENV_IDS for e in env_ids) or args.rounds < 1 or args.slices < 1:
        parser.exit(2, f"error: --envs {args.envs!r} / --rounds {args.rounds} / --slices {args.slices}: valid are "
                       f"{', '.join(ENV_IDS)}, rounds >= 1 and slices >= 1\n")
    seconds = QUICK_S if args.quick else args.seconds
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    print(f"env-steps/s, one CPU thread, {args.rounds} rounds of >= {seconds} s per side, each {args.slices} "
          f"alternating slices per side (ours, peer, ...), a side's rate = its best slice, the same for both; "
          f"a thrown-away warm-up round first (torch {torch.__version__}); load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    print(f"{'env':<12} {'envs':>6} {'ours M/s':>9} {'peer M/s':>9}   ours / peer per round: wall (cpu)")
    results = []
    for env_id in env_ids:
        for n in args.sizes:
            if args.quick and n > QUICK_PEER_LIMIT.get(env_id, n):
                continue
            results.append(side_by_side(env_id, n, seconds, args.rounds, args.slices))
            _print_side_by_side(results[-1])
    extra_rows = [] if args.quick or args.smoke else extras(seconds)
    if extra_rows:
        print(f"\nCartPole-v1, one round each\n{'contender':<34} {'envs':>6} {'wall M/s':>9} {'cpu M/s':>9}")
        for name, n, rate in extra_rows:
            print(f"{name:<34} {n:>6} {rate['wall'] / 1e6:>9.3f} {rate['cpu'] / 1e6:>9.3f}")
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    rows, ratios = [], []
    for res in results:
        for i, r in enumerate(res["rounds"], 1):
            rows.append({"round": i, "env": res["env_id"], "envs": res["num_envs"], "peer": res["peer"],
                         "ours M env-steps/s": r["ours"]["wall"] / 1e6, "peer M env-steps/s": r["peer"]["wall"] / 1e6,
                         "ours / peer (wall)": r["ratio_wall"], "ours / peer (cpu)": r["ratio_cpu"],
                         "ours / peer (wall, mean of slices)": r["ratio_wall_mean"],
                         **({"envpool (1 thread) M env-steps/s": r["envpool"]["wall"] / 1e6,
                             "ours / envpool (wall)": r["ratio_envpool_wall"]} if "envpool" in r else {})})
            ratios.append(_record.ratio(f"ours / {res['peer']}, {res['env_id']} {res['num_envs']:,} envs",
                                        r["ratio_wall"], i, target=res["target"]))
            if "envpool" in r:
                ratios.append(_record.ratio(f"ours / envpool (1 thread), {res['env_id']} {res['num_envs']:,} envs",
                                            r["ratio_envpool_wall"], i))
    config = {"seconds_per_measurement": seconds, "rounds": args.rounds, "slices_per_side": args.slices,
              "rate": "a side's best slice (wall and cpu separately); the mean over slices is in the rows too", "threads": 1, "numpy": np.__version__,
              "gymnasium": _record.version("gymnasium"), "load_average_before": load_before,
              "load_average_after": load_after, "unit": "env-steps/s on the wall clock; ratio = ours / peer",
              "extras": [{"contender": name, "num_envs": n, **rate} for name, n, rate in extra_rows]}
    _record.write(args, "envs_cartpole", config, rows, ratios,
                  notes=[f"{res['env_id']} {res['num_envs']:,} envs: target {res['target']:g}x "
                         f"{'met' if res['met_every_round_wall'] else 'NOT met'} in every round" for res in results])
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
