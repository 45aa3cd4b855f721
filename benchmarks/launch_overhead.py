"""Launcher-side time before the workers start: `multigpu train -f nano` vs `torchrun` on the same loop.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/launch_overhead.py [--rounds 3] [--before-src DIR]
    .venv/bin/python benchmarks/launch_overhead.py --quick --json out.json     # what `make bench` runs

What a launcher does between the command and spawning its workers: imports,
argument parsing, config validation, device planning, writing the run file.
Each contender runs in a fresh process (cold imports, like a user's command)
up to the one call into torch's agent, which is replaced by a stub that records
the time; so the figures are the launcher's own, without the workers:

* ``ours``: ``python -m multigpu train -f nano --nproc-per-node 2 ...``, the
  agent seam ``multigpu.launch.agent._elastic_launch`` stubbed;
* ``torchrun``: ``torchrun --standalone --nproc-per-node 2 benchmarks/_train_peer.py raw ...``
  (``torch.distributed.run.main``), its ``elastic_launch`` stubbed;
* ``before`` (with ``--before-src DIR``): ours from another source tree, e.g. the
  commit before a change (``git archive BASE src | tar -x -C /tmp/base``).

Reported per round (contenders alternate within each round): wall seconds from
the process's start to the stub, and CPU seconds of the process by then (the
steadier figure on a shared machine), and ours - torchrun.
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
BENCH = ["log_every=0", "eval_every=0", "checkpoint_every=0", "sample_chars=0"]

_STUB = """
import json, os, sys, time
import psutil
def _stamp(*args, **kwargs):
    out = {"wall_s": time.time() - psutil.Process().create_time(), "cpu_s": time.process_time(),
           "torch_imported": "torch" in sys.modules, "modules": len(sys.modules)}
    with open(os.environ["LAUNCH_OVERHEAD_OUT"], "w") as fh:
        json.dump(out, fh)
    return lambda *a, **k: {}
"""

_OURS = _STUB + """
import multigpu.launch.agent as agent
agent._elastic_launch = lambda config, entrypoint, args: _stamp()()
from multigpu.cli import main
sys.exit(main(sys.argv[1:]))
"""

_TORCHRUN = _STUB + """
import torch.distributed.run as run
run.elastic_launch = lambda config, entrypoint: _stamp()
run.main(sys.argv[1:])
"""


def measure(name: str, tmp: Path, nproc: int, steps: int, src: str | None) -> dict:
    out = tmp / f"{name}-{len(list(tmp.iterdir()))}.json"
    pythonpath = [p for p in (src, str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p]
    env = {**os.environ, "LAUNCH_OVERHEAD_OUT": str(out), "PYTHONPATH": os.pathsep.join(pythonpath)}
    if name == "torchrun":
        cmd = [sys.executable, "-c", _TORCHRUN, "--standalone", "--nproc-per-node", str(nproc),
               "benchmarks/_train_peer.py", "raw", str(tmp / "peer.json"), str(steps), *BENCH]
    else:
        cmd = [sys.executable, "-c", _OURS, "train", "-f", "nano", "--nproc-per-node", str(nproc),
               "--run-dir", str(tmp / out.stem), f"steps={steps}", *BENCH]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-1000:]}{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--before-src", default=None, metavar="DIR", help="also measure multigpu from this src tree")
    args = _record.add_flags(parser).parse_args()
    if args.quick:
        args.rounds = 3
    if args.smoke:
        args.rounds = 1
    names = ["ours", *(["before"] if args.before_src else []), "torchrun"]
    rows, ratios = [], []
    print(f"launcher start -> spawn, nano, {args.nproc} ranks; load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="launch_overhead_") as tmp:
        for r in range(1, args.rounds + 1):
            got = {}
            for name in names:
                got[name] = measure(name, Path(tmp), args.nproc, args.steps,
                                    args.before_src if name == "before" else None)
                rows.append({"round": r, "contender": name, "wall to spawn (s)": got[name]["wall_s"],
                             "CPU to spawn (s)": got[name]["cpu_s"], "modules loaded": got[name]["modules"],
                             "load": os.getloadavg()[0]})
                print(f"round {r} {name:<9} wall {got[name]['wall_s']:6.2f} s  cpu {got[name]['cpu_s']:6.2f} s  "
                      f"modules {got[name]['modules']}", flush=True)
            for name in names[:-1]:
                for what in ("wall", "cpu"):
                    ratios.append(_record.ratio(f"{name} - torchrun, {what} to spawn (s)",
                                                got[name][f"{what}_s"] - got["torchrun"][f"{what}_s"], r))
    for name in names:
        mine = [x for x in rows if x["contender"] == name]
        print(f"{name:<9} median wall {statistics.median(x['wall to spawn (s)'] for x in mine):.2f} s, "
              f"median CPU {statistics.median(x['CPU to spawn (s)'] for x in mine):.2f} s")
    _record.write(args, "launch_overhead", {"nproc": args.nproc, "rounds": args.rounds, "contenders": names,
                                            "before_src": args.before_src}, rows, ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
