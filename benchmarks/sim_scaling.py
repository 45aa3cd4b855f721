"""Scaling of `multigpu sim` from 1 to 2 ranks for each strategy, strong and weak, with comm share and imbalance.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/sim_scaling.py [--agents 4_000_000] [--steps 20]
    .venv/bin/python benchmarks/sim_scaling.py --quick --json out.json     # what `make bench` runs

Strong scaling keeps the global agent count; weak scaling multiplies it by the
rank count (what ``multigpu bench --weak`` does through the run context). Every run goes
through the real command line and reads the StepMeter's summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]


def _run(strategy: str, nproc: int, agents: int, steps: int, weak: bool, config: str, extra: tuple = ()) -> dict:
    with tempfile.TemporaryDirectory(prefix="sim_scaling_") as tmp:
        env = dict(os.environ)
        agents = agents * (nproc if weak else 1)  # weak scaling: the same agents per rank
        cmd = [sys.executable, "-m", "multigpu", "sim", "-f", config, "--agents", str(agents), "--steps", str(steps),
               "--nproc-per-node", str(nproc), "--strategy", strategy, "--run-dir", tmp, "plot=false", *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        return json.loads((Path(tmp) / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=lambda s: int(float(s.replace("_", ""))), default=4_000_000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--config", default="sir")
    parser.add_argument("--strategies", default="data,spatial,adaptive")
    parser.add_argument("--modes", default="strong,weak")
    args = _record.add_flags(parser).parse_args()
    if args.quick:
        args.agents, args.steps, args.strategies = 1_000_000, 10, "data,spatial"
    if args.smoke:  # one strategy on 1 rank, tiny: checks the script, not the speed
        args.agents, args.steps, args.strategies, args.modes = 10_000, 2, "spatial", ""
    print(f"{'strategy':<9} {'mode':<6} {'ranks':>5} {'agents':>12} {'agent-steps/s':>14} {'speedup':>8} "
          f"{'eff.':>6} {'comm':>6} {'imbal.':>7}")
    rows = []
    for strategy in args.strategies.split(","):
        # smoke: no torch.compile (its build takes longer than the run)
        one = _run(strategy, 1, args.agents, args.steps, False, args.config, ("compile=false",) if args.smoke else ())
        if not args.modes:  # no 2-rank run asked for: the 1-rank figure alone
            rows.append({"strategy": strategy, "mode": "-", "ranks": 1, "agents": one["num_agents"],
                         "throughput": one["throughput"], "comm_share": one["comm_share"],
                         "imbalance": one["imbalance"], "speedup": 1.0})
        for mode, weak in (("strong", False), ("weak", True)):
            if mode not in args.modes.split(","):
                continue
            two = _run(strategy, 2, args.agents, args.steps, weak, args.config)
            for s, ranks in ((one, 1), (two, 2)):
                speedup = s["throughput"] / one["throughput"]
                print(f"{strategy:<9} {mode:<6} {ranks:>5} {s['num_agents']:>12,} {s['throughput']:>14,.0f} "
                      f"{speedup:>7.2f}x {speedup / ranks:>6.0%} {s['comm_share']:>6.1%} {s['imbalance']:>7.2f}",
                      flush=True)
                rows.append({"strategy": strategy, "mode": mode, "ranks": ranks, "agents": s["num_agents"],
                             "throughput": s["throughput"], "comm_share": s["comm_share"],
                             "imbalance": s["imbalance"], "speedup": speedup})
    print("JSON " + json.dumps(rows))
    ratios = [_record.ratio(f"2 ranks / 1 rank agent-steps/s, {r['strategy']} {r['mode']}", r["speedup"])
              for r in rows if r["ranks"] == 2]
    _record.write(args, "sim_scaling", {"agents": args.agents, "steps": args.steps, "config": args.config,
                                        "strategies": args.strategies.split(","), "modes": [m for m in args.modes.split(",") if m]},
                  rows, ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
