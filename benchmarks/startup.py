"""Time to first step: `multigpu launch` vs `torchrun` on the same 2-rank gloo script, in alternating rounds, and
where the built-in workloads' start-up goes.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/startup.py [--rounds 5]
    .venv/bin/python benchmarks/startup.py --quick --json out.json      # what `make bench` runs

The script is what every job does before its first step: ``init_process_group("gloo")``, a barrier, and
``destroy_process_group()`` (tests/scripts-style, written to a temporary folder). Each round runs, in turn,
each a fresh command as a user types it, timed from its start to its exit:

* ``ours``: ``python -m multigpu launch --standalone --nproc-per-node 2 script.py`` (the command line: its
  workers are forked from its fork server, torch already imported);
* ``ours, fresh workers``: the same launch called from code (``multigpu.cli.main(argv)``), whose workers are
  new interpreters, as torchrun's are: what the fork server saves, in the same run;
* ``torchrun``: ``torchrun --standalone --nproc-per-node 2 script.py``;
* ``import torch``: ``python -c "import torch"``, the floor: a launcher imports it once, and so does every
  worker that is a new interpreter.

Wall seconds of the whole command and CPU seconds of it and every process it waited for (``getrusage``), per
round; the ratios are ours / torchrun in each round (target: <= 0.8 on the wall clock). Then each
built-in workload (sim, train, rl) runs once on 2 ranks, and its ``summary.json`` says where its start-up went
(launcher, rendezvous, worker start, to the process group, set-up, first step: :mod:`multigpu.monitor.startup`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.8
"""ours / torchrun, time from the command to the end of an empty 2-rank gloo job."""

SCRIPT = """import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
"""

_CALLED = "import sys; from multigpu.cli import main; sys.exit(main(sys.argv[1:]))"
"""The launcher called from code: its workers are new interpreters."""

WORKLOADS = {
    "sim": ["sim", "-f", "sir", "agents=1_000_000", "steps=3", "plot=false"],
    "train": ["train", "-f", "nano", "steps=3", "log_every=0", "eval_every=0", "checkpoint_every=0", "sample_chars=0"],
    "rl": ["rl", "-f", "ppo-cartpole", "total_env_steps=32768", "checkpoint_every=0"],
}
"""Each built-in workload, small enough that its start-up is most of the run."""


def _torchrun() -> list[str]:
    near = Path(sys.executable).with_name("torchrun")
    return [str(near)] if near.is_file() else [sys.executable, "-m", "torch.distributed.run"]


def _timed(cmd: list[str], env: dict[str, str], timeout: float = 600) -> dict:
    """Wall and CPU seconds of ``cmd`` (its children's CPU included), run from the repository root."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{proc.stdout[-1000:]}{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu}


def contenders(script: Path) -> dict[str, list[str]]:
    launch = ["launch", "--standalone", "--nproc-per-node", "2", str(script)]
    return {
        "ours": [sys.executable, "-m", "multigpu", *launch],
        "ours, fresh workers": [sys.executable, "-c", _CALLED, *launch],
        "torchrun": [*_torchrun(), "--standalone", "--nproc-per-node", "2", str(script)],
        "import torch": [sys.executable, "-c", "import torch"],
    }


def workload_startup(name: str, args: list[str], env: dict[str, str], tmp: Path) -> dict:
    run_dir = tmp / f"run_{name}"
    shutil.rmtree(run_dir, ignore_errors=True)
    timed = _timed([sys.executable, "-m", "multigpu", *args, "--nproc-per-node", "2", "--run-dir", str(run_dir)], env)
    summary = json.loads((run_dir / "summary.json").read_text())
    found = summary.get("startup") or {}
    return {"workload": name, "command": "multigpu " + " ".join(args) + " --nproc-per-node 2",
            **{f"{part} (s)": seconds for part, seconds in (found.get("parts_s") or {}).items()},
            "to first step (s)": found.get("to_first_step_s"), "first step (s)": found.get("first_step_s"),
            "torch import in a worker (s)": found.get("torch_import_s"), "whole command (s)": timed["wall_s"],
            "load": os.getloadavg()[0]}


def _print_round(r: int, got: dict[str, dict]) -> None:
    cells = "  ".join(f"{name} {fig['wall_s']:5.2f} s ({fig['cpu_s']:5.2f} cpu)" for name, fig in got.items())
    ratio = got["ours"]["wall_s"] / got["torchrun"]["wall_s"]
    print(f"round {r}: {cells}   ours / torchrun {ratio:.2f} (cpu {got['ours']['cpu_s'] / got['torchrun']['cpu_s']:.2f})"
          f"; load {os.getloadavg()[0]:.2f}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated of {', '.join(WORKLOADS)}, "
                                                                           "or none")
    args = _record.add_flags(parser).parse_args()
    if args.quick:
        args.rounds = 3
    if args.smoke:
        args.rounds, args.workloads = 1, "none"
    names = [] if args.workloads == "none" else args.workloads.split(",")
    if any(n not in WORKLOADS for n in names) or args.rounds < 1:
        parser.exit(2, f"error: --workloads {args.workloads!r} / --rounds {args.rounds}: valid are "
                       f"{', '.join(WORKLOADS)} or none, and rounds >= 1\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                       if p), "OMP_NUM_THREADS": "1"}
    load_before = os.getloadavg()
    print(f"time to the end of an empty 2-rank gloo job (init, barrier, destroy), {args.rounds} alternating rounds; "
          f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    rows, ratios = [], []
    with tempfile.TemporaryDirectory(prefix="startup_") as tmp_name:
        tmp = Path(tmp_name)
        script = tmp / "first_step.py"
        script.write_text(SCRIPT)
        cmds = contenders(script)
        _timed(cmds["import torch"], env)  # warm the page cache alike for all
        for r in range(1, args.rounds + 1):
            got = {name: _timed(cmd, env) for name, cmd in cmds.items()}
            _print_round(r, got)
            for name, fig in got.items():
                rows.append({"round": r, "contender": name, "wall (s)": fig["wall_s"], "cpu (s)": fig["cpu_s"],
                             "load": os.getloadavg()[0]})
            for what in ("wall", "cpu"):
                ratios.append(_record.ratio(f"ours / torchrun, {what} s, empty 2-rank gloo job",
                                            got["ours"][f"{what}_s"] / got["torchrun"][f"{what}_s"], r,
                                            **({"target": TARGET} if what == "wall" else {})))
            ratios.append(_record.ratio("ours, fresh workers / torchrun, wall s, empty 2-rank gloo job",
                                        got["ours, fresh workers"]["wall_s"] / got["torchrun"]["wall_s"], r))
        medians = {name: statistics.median(x["wall (s)"] for x in rows if x["contender"] == name) for name in cmds}
        print("median wall: " + ", ".join(f"{name} {s:.2f} s" for name, s in medians.items())
              + f"; ours / torchrun {medians['ours'] / medians['torchrun']:.2f} (target <= {TARGET})")
        parts = []
        for name in names:
            parts.append(workload_startup(name, WORKLOADS[name], env, tmp))
            p = parts[-1]
            print(f"{name}: first step at {p['to first step (s)']:.2f} s: " + ", ".join(
                f"{k[:-4]} {v:.2f}" for k, v in p.items() if k.endswith(" (s)") and v is not None
                and k not in ("to first step (s)", "whole command (s)")), flush=True)
    met = all(r["value"] <= TARGET for r in ratios if r.get("target"))
    notes = [f"target ours / torchrun <= {TARGET} on the wall clock: {'met' if met else 'NOT met'} in every round",
             "import torch: the floor; a launcher imports it once, a worker that is a new interpreter again "
             "(torchrun's, and ours called from code); ours from the command line forks its workers with it loaded"]
    _record.write(args, "startup", {"rounds": args.rounds, "ranks": 2, "backend": "gloo", "script": SCRIPT,
                                    "contenders": {k: " ".join(v) for k, v in cmds.items()},
                                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
                  rows + parts, ratios, notes)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
