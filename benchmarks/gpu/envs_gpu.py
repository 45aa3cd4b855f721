"""CartPole-v1 env-steps/s on one GPU at 1M, 4M and 16M environments vs gymnasium (and envpool) on every CPU core.

    python benchmarks/gpu/envs_gpu.py [--sizes 1e6,4e6,1.6e7] [--seconds 2] [--procs N]
    python benchmarks/gpu/envs_gpu.py --quick         # 4096 envs on the CPU, 2 peer processes: seconds

Ours is measured at every size first, then the peers' processes start (so they never share the CPU with it).

* ours: ``multigpu.envs`` CartPole on the GPU, next-step autoreset, 16
  pre-drawn batches of random actions on the device (cycled), at least
  ``--seconds`` of steps between two ``cuda.synchronize()``; target >= 1e9 env-steps/s.
* gymnasium: its own vectorized CartPole (``gym.make_vec(..., vectorization_mode="vector_entry_point")``,
  NumPy) in ``--procs`` processes (default: every core), each stepping its share
  of the same number of environments, measured with ``benchmarks/envs_cartpole.py``'s
  loop; the rate is the sum of the processes' rates (they run at the same time).
* envpool, where it imports: one process, ``num_threads = --procs``.

Every rate counts env-steps on the wall clock; each peer's figure is given at
the same number of environments as ours, and the ratio ours / peer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import _common
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs_cartpole  # noqa: E402 - the CPU benchmark's peers and loop, reused as they are


def ours(num_envs: int, seconds: float, device: torch.device) -> dict:
    import multigpu as mg

    envs = mg.envs.make("CartPole-v1", num_envs=num_envs, device=device, seed=0)
    envs.reset()
    gen = torch.Generator().manual_seed(0)
    actions = [torch.randint(0, 2, (num_envs,), generator=gen).to(device) for _ in range(16)]
    for i in range(20):  # warm-up: allocator, kernels
        envs.step(actions[i % 16])
    _common.sync(device)
    steps, start = 0, time.perf_counter()
    while True:
        for _ in range(20):
            envs.step(actions[steps % 16])
            steps += 1
        _common.sync(device)
        wall = time.perf_counter() - start
        if wall >= seconds:
            break
    del envs
    return {"num_envs": num_envs, "steps": steps, "seconds": wall, "env_steps_per_s": num_envs * steps / wall,
            "peak_memory_gib": _common.peak_memory_gib(device)}


def _gym_worker(args: tuple[int, float]) -> dict:
    torch.set_num_threads(1)
    return envs_cartpole.gymnasium_vector(*args)


def gymnasium_on_cores(num_envs: int, seconds: float, procs: int, pool) -> dict:
    try:
        import gymnasium  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"gymnasium is not installed ({exc})"}
    share = -(-num_envs // procs)
    rates = pool.map(_gym_worker, [(share, seconds)] * procs)
    return {"num_envs": share * procs, "procs": procs, "env_steps_per_s": sum(r["wall"] for r in rates),
            "per_process": [r["wall"] for r in rates]}


def envpool_threads(num_envs: int, seconds: float, threads: int) -> dict:
    import numpy as np

    try:
        import envpool

        envs = envpool.make_gymnasium("CartPole-v1", num_envs=num_envs, num_threads=threads, seed=0)
    except Exception as exc:  # noqa: BLE001 - not installed, or its optional asset packages missing
        return {"skipped": f"envpool unavailable ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"}
    envs.reset()
    actions = [a.astype(np.int32) for a in envs_cartpole._random_actions("CartPole-v1", num_envs)]
    rate = envs_cartpole._measure(envs.step, actions, seconds, num_envs)
    return {"num_envs": num_envs, "threads": threads, "env_steps_per_s": rate["wall"]}


def estimate(sizes: list[int], seconds: float, procs: int, peers: bool) -> dict[str, float]:
    """Seconds on the GPU machine: each size measured for ``seconds`` after a warm-up (ours), then the peers'
    pool started (``procs`` interpreters importing torch at once) and each size measured again on the cores
    (making ``num_envs`` gymnasium environments takes about as long as measuring them)."""
    parts = {"start": _common.STARTUP_S, "ours": len(sizes) * (seconds + 1.0)}
    if peers:
        parts |= {"peers' pool start": 8.0, "gymnasium": len(sizes) * (2 * seconds + 1.0),
                  "envpool (when installed)": len(sizes) * 0.5}
    return parts


def main() -> int:
    p = _common.parser(__doc__)
    p.add_argument("--sizes", default="1e6,4e6,1.6e7", help="numbers of environments, comma-separated")
    p.add_argument("--seconds", type=float, default=1.5, help="minimum seconds per measurement")
    p.add_argument("--procs", type=int, default=None, help="peer processes/threads (default: every core)")
    p.add_argument("--no-peers", action="store_true", help="measure ours only")
    _common.add_estimate_flag(p)
    args = p.parse_args()
    try:
        sizes = [int(float(s)) for s in ("4096" if args.quick else args.sizes).split(",")]
    except ValueError:
        print(f"error: --sizes {args.sizes!r} is not a list of numbers such as 1e6,4e6", file=sys.stderr)
        return 2
    procs = args.procs or (2 if args.quick else len(os.sched_getaffinity(0)))
    seconds = 0.3 if args.quick else args.seconds
    if min(sizes) < 1 or procs < 1 or not seconds > 0:
        print("error: --sizes, --procs and --seconds must be positive", file=sys.stderr)
        return 2
    device = _common.pick_device("cpu" if args.quick and args.device == "auto" else args.device)
    torch.set_num_threads(1 if device.type == "cpu" else torch.get_num_threads())
    print(f"CartPole-v1 on {device} vs gymnasium/envpool on {procs} CPU process(es)/thread(s), >= {seconds} s each",
          flush=True)
    if args.estimate:
        return _common.print_estimate(estimate(sizes, seconds, procs, not args.no_peers))
    # ours at every size first, alone on the machine: the peers' processes (one per core, each importing torch
    # as it starts) must not share the CPU that feeds the GPU while ours is measured
    rows = [{"num_envs": n, "ours": ours(n, seconds, device)} for n in sizes]
    # started once: every size reuses it. Fresh interpreters on the GPU machine (a fork would copy CUDA's state);
    # --quick on the CPU forks them: no CUDA here, and each spawned one spent its seconds importing torch again
    start = "fork" if args.quick and device.type == "cpu" and "fork" in mp.get_all_start_methods() else "spawn"
    pool = None if args.no_peers else mp.get_context(start).Pool(procs)
    for row in rows:
        n = row["num_envs"]
        if pool is not None:
            row["gymnasium"] = gymnasium_on_cores(n, seconds, procs, pool)
            row["envpool"] = envpool_threads(n, seconds, procs)
        line = f"  {n:>11,} envs: ours {row['ours']['env_steps_per_s']:>16,.0f} env-steps/s"
        for peer in ("gymnasium", "envpool"):
            r = row.get(peer)
            if r is None:
                continue
            if "skipped" in r:
                line += f"; {peer} skipped ({r['skipped']})"
            else:
                row[f"ours_vs_{peer}"] = row["ours"]["env_steps_per_s"] / r["env_steps_per_s"]
                line += f"; {peer} {r['env_steps_per_s']:,.0f} ({row[f'ours_vs_{peer}']:.1f}x)"
        print(line, flush=True)
    if pool is not None:
        pool.close()
        pool.join()
    best = max(r["ours"]["env_steps_per_s"] for r in rows)
    ratios = [r["ours_vs_gymnasium"] for r in rows if "ours_vs_gymnasium" in r]
    skipped = [r["gymnasium"]["skipped"] for r in rows if "skipped" in r.get("gymnasium", {})]
    extra = {}
    if skipped and not args.no_peers:  # said in the step's row (collect.py), never a silent "—"
        extra["peer_missing"] = f"{skipped[0]}: run bash benchmarks/gpu/fetch_wheels.sh and carry .whl"
        print(f"  PEER MISSING: {extra['peer_missing']}", flush=True)
    _common.write_record(args.json, {**extra, "summary": f"{best:.3g} env-steps/s at best",
        "benchmark": "envs_gpu", "machine": _common.machine(),
        "config": {"env": "CartPole-v1", "sizes": sizes, "seconds": seconds, "procs": procs, "device": str(device)},
        "ours": [r["ours"] for r in rows], "peer": [{k: v for k, v in r.items() if k != "ours"} for r in rows],
        "ratio": min(ratios) if ratios else None,
        "targets": {"env-steps/s >= 1e9": best >= 1e9, "faster than gymnasium on every core": (
            all(x > 1 for x in ratios) if ratios else None)},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
