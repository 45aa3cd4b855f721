"""SIR agent-steps/s at 100M and 1B agents on one GPU, and the same final agents as the CPU on a small run.

    python benchmarks/gpu/sim_gpu.py [--sizes 1e8,1e9] [--steps 5] [--compile] [--chunk-size 67108864]
    python benchmarks/gpu/sim_gpu.py --quick          # 100k agents on the CPU: seconds

Ours: ``multigpu.sim.SimEngine`` (the engine ``multigpu sim`` runs) on one GPU,
the SIR model of ``benchmarks/sim_throughput.py`` (grid 1000x1000, beta =
gamma = 0.05): populate, one warm-up step (compilation with ``--compile``),
then ``--steps`` timed steps between two ``cuda.synchronize()``. Agent-steps/s
= agents x steps / seconds; target >= 1e10. On a GPU the chunk is large
(``--chunk-size``, default 2**26 agents: a chunk of the CPU's default 2**18
would cost ~4000 kernel launches a substep at 1B agents). Each size runs in
its own subprocess (in this process under ``--quick``), so GPU memory goes back to the
driver between sizes. A child prints each phase as it ends (populate, warm-up step, timed steps) and, when its time
is nearly up, where each of its threads stands (faulthandler): a run cut short says where it was.

Peer, for correctness, first: the same engine on the CPU. A small run (``--check-agents``,
20 steps) on the CPU and on the GPU must end with the same ``state_digest`` (a
hash of every agent) and the same per-step series; its CPU/GPU speed ratio is
reported beside it.

The step's budget (``STEP_BUDGET_S``, which run_all.sh sets; else ``--size-timeout-s`` per child) is shared by
:class:`Budget`: the digest check, then each size, gets what is left less the least each later child needs, and a
child whose share is below that least is not started (recorded as not run) instead of being given a minimum the
step does not have. The record is rewritten after each child, so a cut run keeps what it finished. (The first GPU
call gave every child at least 5 s: 40 + 5 + 5 s in a 55 s step, and the digest check, last, was killed.)
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _common
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sim_throughput import GRID  # noqa: E402 - the CPU benchmark's grid, so the figures compare

PARAMS = {"beta": 0.05, "gamma": 0.05}


def _config(agents: int, steps: int, chunk_size: int, compile_: bool):
    from multigpu.sim import SimConfig

    return SimConfig(model="sir", agents=agents, grid=GRID, steps=steps, chunk_size=chunk_size, compile=compile_,
                     params=PARAMS, plot=False, log_every=0)


def throughput(agents: int, steps: int, chunk_size: int, compile_: bool, device: torch.device) -> dict:
    """Populate, warm up one step, time ``steps`` steps of the SIR model on ``device`` (this process alone)."""
    import multigpu as mg
    from multigpu.sim import SimEngine

    mg.init(backend=device.type)
    cfg = _config(agents, steps + 1, chunk_size, compile_)
    engine, setup_s = _common.timed(lambda: SimEngine(cfg), device)
    _phase(f"{agents:,} agents populated in {setup_s:.1f} s")
    _, warmup_s = _common.timed(engine.step, device)
    _phase(f"warm-up step {warmup_s:.2f} s")
    _, seconds = _common.timed(lambda: engine.run(steps), device)
    _phase(f"{steps} timed steps {seconds:.2f} s")
    series = engine.series()
    out = {"agents": agents, "steps": steps, "seconds": seconds, "agent_steps_per_s": agents * steps / seconds,
           "setup_s": setup_s, "warmup_step_s": warmup_s, "bytes_per_agent": engine.state.bytes_per_agent,
           "peak_memory_gib": _common.peak_memory_gib(device), "chunk_size": chunk_size, "compile": compile_,
           "final": {k: series[k][-1] for k in ("S", "I", "R")}}
    mg.shutdown()
    return out


def _phase(text: str) -> None:
    """A child's progress, on stderr as it happens (the parent passes it through)."""
    print(f"    [{os.getpid()}] {text}", file=sys.stderr, flush=True)


def digest_check(agents: int, steps: int, chunk_size: int, compile_: bool, device: torch.device) -> dict:
    """The same small run on the CPU and on ``device``: equal digests and series, and the speed of each."""
    import multigpu as mg
    from multigpu.sim import run

    runs = {}
    for where, dev in (("cpu", torch.device("cpu")), ("device", device)):
        mg.init(backend=dev.type)
        cfg = _config(agents, steps, chunk_size if dev.type == "cuda" else 1 << 18, compile_ and dev.type == "cuda")
        result, seconds = _common.timed(lambda cfg=cfg: run(cfg), dev)
        _phase(f"digest run on {dev.type}: {seconds:.2f} s")
        runs[where] = {"digest": result.summary["state_digest"], "series": result.series, "seconds": seconds}
        mg.shutdown()
    same_series = runs["cpu"]["series"] == runs["device"]["series"]
    return {"agents": agents, "steps": steps, "device": str(device), "cpu_digest": runs["cpu"]["digest"],
            "device_digest": runs["device"]["digest"], "same_digest": runs["cpu"]["digest"] == runs["device"]["digest"],
            "same_series": same_series, "cpu_seconds": runs["cpu"]["seconds"], "device_seconds": runs["device"]["seconds"],
            "device_vs_cpu": runs["cpu"]["seconds"] / runs["device"]["seconds"]}


def _in_child(kind: str, kwargs: dict, timeout_s: float, inline: bool = False) -> dict:
    if inline:  # --quick: in this process (the smoke test's time is mostly torch imports)
        fn = throughput if kind == "throughput" else digest_check
        return fn(device=_common.pick_device(kwargs["device"]), **{k: v for k, v in kwargs.items() if k != "device"})
    # the child's stderr goes straight to ours (its phases, and its threads' stacks 2 s before its deadline)
    argv = [sys.executable, __file__, "--child", kind, json.dumps({**kwargs, "deadline_s": timeout_s - 2})]
    try:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f}s (its stacks are printed above)", **kwargs}
    result = _common.child_result(proc.stdout)
    if result is None:
        return {"error": f"exit code {proc.returncode} without a result (its stderr is above)", **kwargs}
    return result


def _budget(default_s: float) -> float:
    """Seconds this script may still use: run_all.sh's STEP_BUDGET_S (the step's cap) from now, else ``default_s``."""
    try:
        return float(os.environ["STEP_BUDGET_S"])
    except (KeyError, ValueError):
        return default_s


def estimate(sizes: list[int], steps: int, check_agents: float, compile_: bool) -> dict[str, float]:
    """Seconds on one H100: a process per size (populating at 5e8 agents/s, stepping at 5e9 agent-steps/s: half
    the target), the digest run's process (20 steps on the CPU at 1e8 agent-steps/s, and on the GPU)."""
    parts = {"start": 5.0}
    for n in sizes:
        parts[f"{n:.0e} agents"] = _common.STARTUP_S + n / 5e8 + (1 + steps) * n / 5e9 + (30.0 if compile_ else 0.0)
    parts["digest check"] = _common.STARTUP_S + 2 * 20 * check_agents / 1e8
    return parts


def main() -> int:
    p = _common.parser(__doc__)
    p.add_argument("--sizes", default="1e8,1e9", help="agent counts, comma-separated")
    p.add_argument("--steps", type=int, default=5, help="timed steps per size (after one warm-up step)")
    p.add_argument("--chunk-size", type=int, default=1 << 26, help="agents per kernel call on a GPU")
    p.add_argument("--compile", action="store_true", help="fuse the kernels with torch.compile (Triton on a GPU)")
    p.add_argument("--check-agents", type=float, default=1e6, help="agents of the CPU-vs-GPU digest run")
    p.add_argument("--size-timeout-s", type=float, default=240.0)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    _common.add_estimate_flag(p)
    args = p.parse_args()
    if args.child:
        kind, kwargs = args.child[0], json.loads(args.child[1])
        faulthandler.dump_traceback_later(max(1.0, kwargs.pop("deadline_s")), exit=False)
        fn = throughput if kind == "throughput" else digest_check
        print("RESULT " + json.dumps(fn(device=_common.pick_device(kwargs.pop("device")), **kwargs)), flush=True)
        return 0
    try:
        sizes = [int(float(s)) for s in ("1e5" if args.quick else args.sizes).split(",")]
    except ValueError:
        print(f"error: --sizes {args.sizes!r} is not a list of numbers such as 1e8,1e9", file=sys.stderr)
        return 2
    if args.steps < 1 or min(sizes) < 1 or args.chunk_size < 1024:
        print("error: --steps and --sizes must be >= 1 and --chunk-size >= 1024", file=sys.stderr)
        return 2
    if args.estimate:
        return _common.print_estimate(estimate(sizes, args.steps, args.check_agents, args.compile))
    device = "cpu" if args.quick and args.device == "auto" else args.device
    dev = _common.pick_device(device)
    steps = 2 if args.quick else args.steps
    chunk = args.chunk_size if dev.type == "cuda" else 1 << 18
    check_agents = 20_000 if args.quick else int(args.check_agents)
    print(f"SIR on {dev}: sizes {sizes}, {steps} timed steps, chunk {chunk}, compile {args.compile}", flush=True)
    clock = Budget(_budget(args.size_timeout_s * (len(sizes) + 1)), args.size_timeout_s)
    config = {"model": "sir", "grid": GRID, "params": PARAMS, "steps": steps, "chunk_size": chunk,
              "compile": args.compile, "budget_s": round(clock.total, 1)}
    machine = _common.machine()  # once: it asks NVML
    # the digest check first (the CPU and the GPU agree, or nothing else counts), keeping back for each size
    # the least a child needs: it is never cut by the sizes that come after it
    check = clock.run(lambda s: _in_child("digest", {"agents": check_agents, "steps": 20, "chunk_size": chunk,
                                                      "compile_": args.compile, "device": device}, s, args.quick),
                      reserve=len(sizes))
    if "error" in check:
        print(f"  digest check failed: {check['error']}", flush=True)
    else:
        print(f"  {check_agents:,} agents x 20 steps: CPU digest {check['cpu_digest']}, {dev.type} digest "
              f"{check['device_digest']}: {'equal' if check['same_digest'] and check['same_series'] else 'DIFFERENT'}; "
              f"{dev.type} {check['device_vs_cpu']:.1f}x the CPU's speed", flush=True)
    rows = []
    for i, n in enumerate(sizes):
        start = time.perf_counter()
        r = clock.run(lambda s, n=n: _in_child("throughput", {"agents": n, "steps": steps, "chunk_size": chunk,
                                                              "compile_": args.compile, "device": device}, s, args.quick),
                      reserve=len(sizes) - i - 1, what={"agents": n})
        r["wall_s"] = time.perf_counter() - start
        rows.append(r)
        if "error" in r:
            print(f"  {n:>14,} agents: failed: {r['error']}", flush=True)
        else:
            print(f"  {n:>14,} agents: {r['agent_steps_per_s']:>18,.0f} agent-steps/s  ({r['seconds'] / steps * 1e3:.1f} "
                  f"ms/step, setup {r['setup_s']:.1f} s, peak {r['peak_memory_gib'] or 0:.1f} GiB)", flush=True)
        _common.write_record(args.json, _record(machine, config, rows, check), quiet=True)
    _common.write_record(args.json, _record(machine, config, rows, check))
    return 0 if all("error" not in r for r in [*rows, check]) else 1


def _record(machine: dict, config: dict, rows: list[dict], check: dict) -> dict:
    best = max((r["agent_steps_per_s"] for r in rows if "error" not in r), default=None)
    return {"benchmark": "sim_gpu", "machine": machine, "config": config, "ours": rows,
            "peer": {"name": "the same engine on the CPU (digest check)", **check},
            "ratio": check.get("device_vs_cpu"),
            "summary": f"{best:.3g} agent-steps/s at best" if best is not None else None,
            "targets": {"agent-steps/s >= 1e10": best >= 1e10 if best is not None else None,
                        "same digest as the CPU": (bool(check.get("same_digest") and check.get("same_series"))
                                                   if "error" not in check else None)}}


class Budget:
    """The step's seconds, shared between this script's children: a child gets what is left less what the children
    after it need at least (``MIN_CHILD_S`` each) and less this script's own end (``EXIT_S``), never more than
    ``per_child_s``; one that would get less than ``MIN_CHILD_S`` is not started (recorded as not run), so no
    child's minimum pushes the step past its cap."""

    MIN_CHILD_S = _common.STARTUP_S + 4.0
    """A child process starting (Python, torch, CUDA) and doing anything at all."""
    EXIT_S = 2.0
    """This script's last record and exit."""

    def __init__(self, total_s: float, per_child_s: float):
        # from this process's start: its own imports are the step's seconds too
        self.total, self.per_child = total_s, per_child_s
        self.began = time.perf_counter() - _common.process_age_s()

    def left(self) -> float:
        return self.total - (time.perf_counter() - self.began) - self.EXIT_S

    def run(self, fn, reserve: int, what: dict | None = None) -> dict:
        """``fn(seconds)`` with this child's share, or a not-run record when the share is too small."""
        share = min(self.per_child, self.left() - reserve * self.MIN_CHILD_S)
        if share < self.MIN_CHILD_S:
            return {"error": f"not run: {max(share, 0):.0f} s of the step's {self.total:.0f} s left for it "
                             f"(a child needs {self.MIN_CHILD_S:.0f} s)", **(what or {})}
        return fn(share)


if __name__ == "__main__":
    raise SystemExit(main())
