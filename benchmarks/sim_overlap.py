"""SIR on 2 ranks: the C kernels vs torch.compile, and overlapped vs synchronous communication (same run).

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/sim_overlap.py [--agents 10_000_000] [--steps 30]
        [--variants native=off:overlap=off,native=on:overlap=off,native=on:overlap=on] [--rounds 2]
        [--quick | --smoke] [--json PATH]

``--quick`` (what `make bench` runs: "10M SIR agents on 2 ranks, spatial, target 3e8 agent-steps/s"):
10M agents, 20 steps, the torch kernels (the specification) vs the C kernels, 3 rounds.

Every variant runs through the real command line (``multigpu sim -f sir --nproc-per-node 2 --strategy ...``)
in rounds that alternate the variants, and reads the StepMeter's summary.json (throughput after one
warm-up step, comm share, per-phase seconds). The state digest must be the same for every variant
(the results are bit-identical); the script stops if it is not.
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
TARGET = 3e8
"""The target for 10M SIR agents on 2 ranks of the 2-core machine, spatial (agent-steps/s; earlier: 1.5e8)."""


def _run(agents: int, steps: int, strategy: str, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory(prefix="sim_overlap_") as tmp:
        cmd = [sys.executable, "-m", "multigpu", "sim", "-f", "sir", "--agents", str(agents), "--steps", str(steps),
               "--nproc-per-node", "2", "--strategy", strategy, "--run-dir", tmp, "plot=false", *overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), cwd=ROOT, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        return json.loads((Path(tmp) / "summary.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=lambda s: int(float(s.replace("_", ""))), default=10_000_000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--strategy", default="spatial")
    parser.add_argument("--variants", default="native=off:overlap=off,native=on:overlap=off,native=on:overlap=on")
    parser.add_argument("--rounds", type=int, default=2)
    args = _record.add_flags(parser).parse_args()
    if args.quick:
        args.agents, args.steps, args.rounds = 10_000_000, 20, 3
        args.variants = "native=off:overlap=off,native=on:overlap=off"
    if args.smoke:  # checks the script, not the speed
        args.agents, args.steps, args.rounds = 20_000, 3, 1
        args.variants = "native=off:overlap=off,native=on:overlap=off"
    variants = args.variants.split(",")
    base = None
    rows, digests = [], set()
    print(f"{'round':>5} {'variant':<28} {'agent-steps/s':>14} {'vs first':>8} {'comm':>6} {'step phases (rank 0, s)'}")
    for r in range(1, args.rounds + 1):
        for i, variant in enumerate(variants):
            # smoke: no torch.compile for the torch kernels (its build takes longer than the run)
            s = _run(args.agents, args.steps, args.strategy, variant.split(":") + (["compile=false"] if args.smoke else []))
            digests.add(s["state_digest"])
            if i == 0:
                base = s["throughput"]
            phases = {k: round(v, 2) for k, v in sorted(s["phases_s"][0].items(), key=lambda kv: -kv[1])}
            print(f"{r:>5} {variant:<28} {s['throughput']:>14,.0f} {s['throughput'] / base:>7.2f}x "
                  f"{s['comm_share']:>6.1%} {phases}", flush=True)
            rows.append({"round": r, "variant": variant, "agents": s["num_agents"], "throughput": s["throughput"],
                         "comm_share": s["comm_share"], "phases_s": s["phases_s"], "digest": s["state_digest"],
                         "peak_rss_mb": s["peak_rss_mb"]})
    if len(digests) != 1:
        raise SystemExit(f"the variants ended in different states: {sorted(digests)}")
    digest = digests.pop()
    print(f"same final state in every run: digest {digest}")
    print("JSON " + json.dumps(rows))
    first = variants[0]
    ratios, notes = [], [f"same final state digest in every run: {digest}"]
    for row in rows:
        if row["variant"] != first:
            base = next(b for b in rows if b["round"] == row["round"] and b["variant"] == first)
            ratios.append(_record.ratio(f"{row['variant']} / {first} agent-steps/s", row["throughput"] / base["throughput"],
                                        row["round"]))
    if args.agents == 10_000_000:
        for variant in variants:
            got = [r["throughput"] for r in rows if r["variant"] == variant]
            met = "met" if all(g >= TARGET for g in got) else "NOT met"
            notes.append(f"{variant}: target {TARGET:.1e} agent-steps/s (10M agents, 2 ranks) {met} in every round "
                         f"({', '.join(f'{g:.3g}' for g in got)})")
    _record.write(args, "sim_overlap", {"agents": args.agents, "steps": args.steps, "strategy": args.strategy,
                                        "variants": variants, "rounds": args.rounds, "ranks": 2,
                                        "unit": "agent-steps/s after one warm-up step"},
                  [{k: v for k, v in r.items() if k != "phases_s"} for r in rows], ratios, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
