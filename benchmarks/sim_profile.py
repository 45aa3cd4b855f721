"""Where one SIR step's time goes on each of 2 ranks, per phase, against the copy bandwidth measured in the same run.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/sim_profile.py [--agents 10_000_000] [--steps 20]
        [--overlap off] [--native on]

Two real gloo ranks (``multigpu.testing.run_on_ranks``, one thread each) run the spatial SIR engine
(grid 1000 x 1000, the sir preset's parameters). Each rank first measures its copy bandwidth while the
other copies too (``dst.copy_(src)`` of 128 MiB, read + write bytes/s: the bandwidth a rank has when both
work), then one warm-up step, then ``--steps`` timed steps with every kernel call, the migration's parts
(pack, the two all-to-alls, remove, unpack + append), the sort and the series all-reduce timed on their own;
"python" is the rest of the step (Python and the small torch ops around the kernels). "step, CPU time" is the
rank's process CPU time per step: on a shared machine the wall time above it is time the rank did not run. Bytes/agent-step is the least traffic of a phase (the agent fields it
must read and write, per agent and step; the sort's reorder and the migration amortized over the steps);
"of bw" = bytes moved per second of that phase / the copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

GRID = (1000, 1000)
PARAMS = {"beta": 0.05, "gamma": 0.05, "initial_infected": 0.001, "move_prob": 0.5}


def _copy_bandwidth() -> float:
    src = torch.ones(1 << 27, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() / best


def _timed(timers: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        timers[name] += time.perf_counter() - t
        return out
    return wrapper


def _rank(agents: int, steps: int, overlap: str, native_opt: str, sort_every: int) -> dict:
    import torch.distributed as dist

    from multigpu.runtime import collectives
    from multigpu.sim import SimConfig, SimEngine, exchange, native
    from multigpu.sim import engine as engine_mod

    collectives.barrier()
    bw = _copy_bandwidth()  # both ranks copy at once
    cfg = SimConfig(model="sir", agents=agents, grid=GRID, steps=steps + 1, strategy="spatial", native=native_opt,
                    overlap=overlap, sort_every=sort_every, params=PARAMS)
    engine = SimEngine(cfg)
    timers: dict[str, float] = defaultdict(float)
    ctx = engine.ctx
    for name in ("move", "infected", "transition", "move_count", "thresholds"):
        ctx.kernels[name] = _timed(timers, name, ctx.kernels[name])
    engine_mod.native.outside = _timed(timers, "strays", native.outside)
    state = engine.state
    state.take = _timed(timers, "migrate: pack", state.take)
    state.pack = _timed(timers, "migrate: pack", state.pack)
    state.remove = _timed(timers, "migrate: remove", state.remove)
    state.unpack = _timed(timers, "migrate: unpack", state.unpack)
    state.append = _timed(timers, "migrate: unpack", state.append)
    a2a, fin = dist.all_to_all_single, exchange.finish
    exchange.dist.all_to_all_single = _timed(timers, "migrate: exchange", a2a)
    timed_fin = _timed(timers, "migrate: exchange", fin)
    exchange.finish = lambda work, op="all_reduce", device=None: (timed_fin if op == "migrate" else fin)(work, op, device)
    engine.flush = _timed(timers, "series reduction", engine.flush)
    migrated = []
    real_migrate = exchange.migrate

    def counting_migrate(st, index, dest, **kw):
        migrated.append(index.numel())
        return real_migrate(st, index, dest, **kw)

    engine_mod.exchange.migrate = counting_migrate
    try:
        engine.run(1)  # warm-up
        timers.clear()
        migrated.clear()
        engine.timers.clear()
        collectives.barrier()
        t, cpu = time.perf_counter(), time.process_time()
        engine.run(steps)
        total, cpu = time.perf_counter() - t, time.process_time() - cpu
    finally:
        exchange.dist.all_to_all_single, exchange.finish = a2a, fin
        engine_mod.exchange.migrate = real_migrate
        engine_mod.native.outside = native.outside
    timers["sort"] = engine.timers.get("sort", 0.0)
    timers["python"] = total - sum(timers.values())  # the rest of the step
    return {"agents": engine.state.n, "bandwidth": bw, "seconds": total, "cpu_seconds": cpu, "phases": dict(timers),
            "migrated_per_step": sum(migrated) / steps, "bytes_per_agent": engine.state.bytes_per_agent,
            "infected": engine.series()["I"][-1]}


def _bytes(phase: str, n: int, migrated: float, rec: int, sort_every: int) -> float:
    """The least traffic of a phase, bytes per agent-step (see the module docstring)."""
    per_agent = {"move": 12, "transition": 10, "strays": 2, "move_count": 13}
    if phase in per_agent:
        return per_agent[phase]
    if phase == "infected":  # move_count counts the agents that stay; this kernel the ones that arrived
        return migrated * 5 / n
    if phase == "sort":  # rows read + order written, then each field gathered and written back
        return (2 + 8 + 2 * rec + 8) / sort_every
    if phase.startswith("migrate"):
        return migrated * 2 * rec / n
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=lambda s: int(float(s.replace("_", ""))), default=10_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--overlap", default="off", choices=["on", "off"])
    parser.add_argument("--native", default="on", choices=["on", "off"])
    parser.add_argument("--sort-every", type=int, default=20)
    args = parser.parse_args()
    from multigpu.testing import run_on_ranks

    ranks = run_on_ranks(_rank, 2, args=(args.agents, args.steps, args.overlap, args.native, args.sort_every),
                         timeout_s=1800, threads=1)
    bws = ", ".join(f"{r['bandwidth'] / 1e9:.1f}" for r in ranks)
    total_rate = args.agents * args.steps / max(r["seconds"] for r in ranks)
    print(f"{args.agents:,} agents, 2 ranks, {args.steps} steps: {total_rate:,.0f} agent-steps/s; "
          f"copy bandwidth per rank (both copying) {bws} GB/s; "
          f"infected at the end {ranks[0]['infected']:,}")
    print(f"{'phase':<20} " + " ".join(f"{'rank ' + str(i) + ' ms/step':>15} {'B/agent-step':>12} {'of bw':>6}"
                                       for i in range(2)))
    phases = sorted(ranks[0]["phases"], key=lambda p: -ranks[0]["phases"][p])
    rows = []
    for p in phases:
        cells = []
        for i, r in enumerate(ranks):
            sec = r["phases"].get(p, 0.0) / args.steps
            b = _bytes(p, r["agents"], r["migrated_per_step"], r["bytes_per_agent"], args.sort_every)
            share = (b * r["agents"] / sec) / r["bandwidth"] if sec and b else 0.0
            cells.append(f"{sec * 1e3:>15.1f} {b:>12.2f} {share:>6.1%}")
            rows.append({"rank": i, "phase": p, "ms_per_step": sec * 1e3, "bytes_per_agent_step": b,
                         "share_of_bw": share})
        print(f"{p:<20} " + " ".join(cells))
    steps_ms = [r["seconds"] / args.steps * 1e3 for r in ranks]
    print(f"{'step':<20} " + " ".join(f"{ms:>15.1f} {'':>12} {'':>6}" for ms in steps_ms))
    cpu_ms = [r["cpu_seconds"] / args.steps * 1e3 for r in ranks]
    print(f"{'step, CPU time':<20} " + " ".join(f"{ms:>15.1f} {'':>12} {'':>6}" for ms in cpu_ms)
          + "  (wall above CPU: the rank waited, or another process had its core)")
    print("JSON " + json.dumps({"agents": args.agents, "steps": args.steps, "rate": total_rate, "rows": rows,
                                "ranks": ranks}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
