"""Benchmark: multigpu's trainer vs raw torchrun+DDP vs Accelerate vs Lightning Fabric, and with FSDP vs raw FSDP2.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/train_peers.py [--steps 30] [--rounds 2]
    .venv/bin/python benchmarks/train_peers.py --quick --json out.json     # what `make bench` runs

Every contender trains the nano GPT of nano (same model, data,
optimizer, schedule, batch) on 2 ranks in this run, one after the other,
the order reversed every other round. Reported per contender (best round):

* steady-state tokens/s: tokens of the steps after the first 2 / their summed
  step times (batch fetch to optimizer step, as multigpu's StepMeter times them);
* launch to first step: from starting the command to the end of rank 0's first step.

Ours runs as `multigpu train` (our launcher + worker); the peers run under
`torchrun` with the loop each library's docs show (benchmarks/_train_peer.py).
A peer that is not installed is skipped with a message. Sharded: ``ours fsdp``
(`multigpu train ... strategy=fsdp`) against ``fsdp2``, torch's ``fully_shard``
on each block and the root with torch's own loop (the pair the FSDP target
reads: ``ours fsdp / fsdp2 tokens/s``), fp32 both, resharding after forward both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]
BENCH = ["log_every=0", "eval_every=0", "checkpoint_every=0", "sample_chars=0"]
SMOKE_SIZE = ["model.kwargs.n_layer=1", "model.kwargs.n_embd=32", "model.kwargs.n_head=2", "batch_size=2",
              "data.kwargs.max_chars=20000"]
"""--smoke: a tiny GPT on a little text for every contender (the test suite checks the script, not the speed)."""


def run_ours(steps: int, tmp: Path, prefetch: int, nproc: int = 2, src: str | None = None,
             strategy: str = "ddp") -> dict:
    """`multigpu train` from this checkout, or from the source tree ``src`` (e.g. an older commit's src/)."""
    run_dir = tmp / f"ours-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH"))))} if src else None
    cmd = [sys.executable, "-m", "multigpu", "train", "-f", "nano", "--nproc-per-node", str(nproc),
           "--run-dir", str(run_dir), f"steps={steps}", f"prefetch={prefetch}", f"strategy={strategy}", *BENCH]
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"throughput": summary["throughput"], "startup_s": summary["first_step_at"] - start}


def run_peer(which: str, steps: int, tmp: Path, nproc: int = 2) -> dict:
    out = tmp / f"{which}-{time.monotonic_ns()}.json"
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), "benchmarks/_train_peer.py", which, str(out),
           str(steps), *BENCH]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // nproc))}
    start = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True, env=env)
    result = json.loads(out.read_text())
    return {"throughput": result["throughput"], "startup_s": result["first_step_at"] - start}


def available(notes: list[str]) -> list[str]:
    names = ["ours", "raw", "ours fsdp", "fsdp2"]
    for peer, module in (("accelerate", "accelerate"), ("fabric", "lightning_fabric")):
        if importlib.util.find_spec(module) is None:
            notes.append(f"skipped {peer}: `{module}` is not installed (pip install {module})")
            print(notes[-1])
        else:
            names.append(peer)
            notes.append(f"{module} {_record.version(module)}")
    return names


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2, help="our trainer's prefetch (the peers have none)")
    parser.add_argument("--only", default=None, help="comma-separated contenders, e.g. ours,raw")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per contender")
    parser.add_argument("--before-src", default=None, metavar="DIR",
                        help="also run `multigpu train` from this source tree as contender 'before' "
                             "(e.g. `git archive BASE src | tar -x -C /tmp/base`: before/after in one run)")
    args = _record.add_flags(parser).parse_args()
    if args.quick:
        args.steps, args.rounds = 30, 2  # 12 steps (10 timed) varied by 10-20% between runs of the same contender
    if args.smoke:  # 1 rank, 3 steps, ours and raw, ours fsdp and fsdp2: checks the script, not the speed
        args.steps, args.rounds, args.only, args.nproc = 3, 1, "ours,raw,ours fsdp,fsdp2", 1
        BENCH.extend(SMOKE_SIZE)
    notes: list[str] = []
    names = [n for n in available(notes) if args.only is None or n in args.only.split(",")]
    if args.before_src:
        names.insert(1, "before")
        notes.append(f"before = multigpu train from {args.before_src}")
    results: dict[str, list[dict]] = {n: [] for n in names}
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:  # reversed every other round: no one always first
                if name in ("ours", "before", "ours fsdp"):
                    src = args.before_src if name == "before" else None
                    res = run_ours(args.steps, Path(tmp), args.prefetch, args.nproc, src,
                                   "fsdp" if name == "ours fsdp" else "ddp")
                else:
                    res = run_peer(name, args.steps, Path(tmp), args.nproc)
                results[name].append(res)
                rows.append({"round": r + 1, "contender": name, "tokens/s": res["throughput"],
                             "launch to first step (s)": res["startup_s"], "load": os.getloadavg()[0]})
                print(f"round {r + 1} {name:<10} {res['throughput']:8,.0f} tokens/s   "
                      f"launch to first step {res['startup_s']:5.1f} s", flush=True)
            ours = results["ours"][r] if "ours" in results else None
            for name in [n for n in names[1:] if n not in ("ours fsdp", "fsdp2")] if ours else []:
                peer = results[name][r]
                ratios.append(_record.ratio(f"ours / {name} tokens/s", ours["throughput"] / peer["throughput"], r + 1))
                ratios.append(_record.ratio(f"ours - {name} launch to first step (s)",
                                            ours["startup_s"] - peer["startup_s"], r + 1))
            if "ours fsdp" in results and "fsdp2" in results:
                mine, peer = results["ours fsdp"][r], results["fsdp2"][r]
                ratios.append(_record.ratio("ours fsdp / raw fsdp2 tokens/s", mine["throughput"] / peer["throughput"],
                                            r + 1))
    _record.write(args, "train_peers", {"steps": args.steps, "rounds": args.rounds, "nproc": args.nproc,
                                        "prefetch": args.prefetch, "contenders": names,
                                        "overrides": BENCH}, rows, ratios, notes)
    best = {n: {"throughput": max(x["throughput"] for x in rs), "startup_s": min(x["startup_s"] for x in rs)}
            for n, rs in results.items()}
    ours = best["ours"]
    print(f"\nnano GPT, {args.nproc} CPU rank(s), {args.steps} steps, best of {args.rounds} round(s), our prefetch={args.prefetch}")
    print(f"{'contender':<12}{'tokens/s':>10}{'ours / it':>11}{'first step (s)':>16}{'ours - it (s)':>15}")
    for name, b in best.items():
        print(f"{name:<12}{b['throughput']:>10,.0f}{ours['throughput'] / b['throughput']:>10.3f}x"
              f"{b['startup_s']:>16.1f}{ours['startup_s'] - b['startup_s']:>+15.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
