"""Every side-by-side benchmark in quick mode, one after the other, into one JSON (what `make bench` runs).

    .venv/bin/python benchmarks/run_all.py [--out benchmarks/results] [--only infer_vs_monai,train_peers]
    .venv/bin/python benchmarks/render.py benchmarks/results/bench.json --results benchmarks/RESULTS.md

Runs outside any rank. Takes /tmp/multigpu-bench.lock itself (waits for it),
then runs each script in ``BENCHMARKS`` as a subprocess with ``--quick --json
<tmpfile>`` and writes ``<out>/bench.json``: the date, the machine (cores,
memory, torch), and per benchmark the command, its status, seconds, the load
average before and after, the installed peers, and the script's record
(per-round figures and ratios, see benchmarks/_record.py). The file is
rewritten after every benchmark, so a run cut short keeps what it finished.
A benchmark that fails is recorded with its last lines and the rest go on; one
that does not write its JSON yet is recorded as "not machine-readable yet".
Peers (accelerate, lightning-fabric, monai, gymnasium, agent-torch, starsim) are optional:
each script skips a missing one and says so in its record. Then
benchmarks/render.py writes ``<out>/bench.md`` and the marked block in RESULTS.md.

The GPU benchmarks (benchmarks/gpu/) run on a GPU machine through
benchmarks/gpu/run_all.sh and are listed here as skipped; so are the
benchmarks in ``LEFT_OUT`` (not comparisons, or too long for the quick set).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import _record

ROOT = Path(__file__).resolve().parents[1]
LOCK = "/tmp/multigpu-bench.lock"


@dataclass(frozen=True)
class Benchmark:
    name: str
    """The script is benchmarks/<name>.py."""
    what: str
    """The comparison, in a few words (the table's first column)."""
    peers: tuple[str, ...] = ()
    """Optional modules the script compares against (recorded as installed or not)."""
    timeout_s: float = 600.0
    args: tuple[str, ...] = field(default=())
    """Extra arguments after --quick."""


BENCHMARKS = (
    Benchmark("startup", "time to the end of an empty 2-rank gloo job: `multigpu launch` vs torchrun (target <= 0.8x); "
              "where the built-in workloads' start-up goes"),
    Benchmark("envs_cartpole", "CartPole env-steps/s: ours vs gymnasium (vector) and envpool", ("gymnasium", "envpool")),
    Benchmark("rl_vs_cleanrl", "PPO CartPole to 475 over 20 episodes: ours 1 and 2 ranks vs CleanRL's ppo.py "
              "(targets: 2 ranks >= 1.6x 1 rank, ours >= 10x CleanRL)", ("gymnasium", "tyro", "tensorboard"),
              timeout_s=1200),
    Benchmark("infer_vs_monai", "sliding window 2048² roi 256 and 1000² roi 160: ours 1 rank vs MONAI, 2 ranks vs 1 "
              "(targets: >= 1.0x MONAI, 2 ranks >= 1.8x 1 rank, every round)", ("monai",)),
    Benchmark("train_peers", "nano GPT, 2 ranks: ours vs raw torchrun+DDP vs Accelerate vs Fabric, and ours with "
              "FSDP vs raw FSDP2 (fully_shard, torch's own loop) (targets: ours / raw >= 1.0, both)",
              ("accelerate", "lightning_fabric")),
    Benchmark("train_scaling", "nano GPT: 1 vs 2 ranks, global batch 32, 1 thread per rank"),
    Benchmark("sim_throughput", "agent-steps/s, 1 thread: ours vs hand-written torch vs AgentTorch", ("agent_torch",)),
    Benchmark("sim_scaling", "SIR: 1 vs 2 ranks per strategy, strong and weak"),
    Benchmark("sim_overlap", "SIR 10M agents, 2 ranks, spatial: C kernels vs the torch kernels (target 3e8 agent-steps/s)"),
    Benchmark("sim_starsim", "SIR on a random network: Starsim vs ours, agreement of the mean curves and time to "
              "the same answer (an ensemble, one large run), 1 and 2 ranks, with start-up and simulating alone "
              "(target starsim / ours >= 5x on 1 rank, >= 9x on 2)", ("starsim",), timeout_s=1200),
)

LEFT_OUT = {
    "envs_ppo_ranks": "PPO wall to solve on 1 vs 2 ranks: rl_vs_cleanrl measures the same (and CleanRL beside it)",
    "rl_shapes": "a sweep of PPO shapes (wall to solve on 1 and 2 ranks per override set): minutes, run by hand",
    "plan_validate": "a check of multigpu plan's model (published figures, and CPU ranks fitted on 1-2, measured at 3-4 "
                     "and another thread count), not a peer comparison; minutes of benches, run by hand under flock",
    "launch_overhead": "the launcher's side only (up to the agent, stubbed), for train: startup measures the whole start",
    "sim_calibrate": "not a side-by-side comparison (calibration accuracy and memory)",
    "infer_memory": "peak memory at 16k², minutes per run; not in the quick set",
    "train_fsdp_memory": "memory of ddp vs fsdp on a 12-layer GPT, minutes per run; not in the quick set",
    "reliability_recovery": "recovery after a SIGKILL, ours vs torchrun: minutes per round; not in the quick set",
    "reliability_orphans": "processes that outlive the launcher: 15 s waits per scenario; not in the quick set",
    "sim_kernels": "a profile of our kernels (C vs torch.compile) against the copy bandwidth, not a peer comparison",
    "sim_profile": "where one 10M-agent SIR step's time goes per rank (per phase, vs the copy bandwidth): a profile",
    "train_step_profile": "per-phase step times of ours vs raw DDP (a profile, run under torchrun), not a peer ratio",
    "train_tracking": "the cost of logger=wandb (needs wandb, offline): not a peer comparison",
    "checkpoint_async": "checkpoint stall sync vs async and write MB/s vs the disk's own: GBs written, run by hand",
    "gpu/": "skipped: no GPU here (GPU machine only: bash benchmarks/gpu/run_all.sh)",
}


def _tail(text: str, lines: int = 15) -> list[str]:
    return text.strip().splitlines()[-lines:]


def run_one(bench: Benchmark, mode: str, scripts: Path, tmp: Path) -> dict:
    """Run one benchmark script; return its entry (never raises for the script's own failure)."""
    out = tmp / f"{bench.name}.json"
    cmd = [sys.executable, str(scripts / f"{bench.name}.py"), f"--{mode}", "--json", str(out), *bench.args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p),
           "PYTHONUNBUFFERED": "1"}
    entry = {"name": bench.name, "what": bench.what, "command": " ".join(
                 ["python", os.path.relpath(cmd[1], ROOT), *cmd[2:4], "<tmp.json>", *bench.args]),
             "peers": {p: _record.version(p.replace("_", "-")) if importlib.util.find_spec(p) else None
                       for p in bench.peers},
             "load_before": list(os.getloadavg())}
    print(f"== {bench.name}: {entry['command']} (load {entry['load_before'][0]:.2f})", flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=bench.timeout_s)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, stdout, stderr = None, _text(exc.stdout), _text(exc.stderr) + f"\ntimed out after {bench.timeout_s:.0f} s"
    entry.update(seconds=round(time.monotonic() - start, 1), load_after=list(os.getloadavg()), rc=rc)
    if rc == 0 and out.exists():
        entry.update(status="ok", record=json.loads(out.read_text()))
    elif rc == 2 and "unrecognized arguments" in stderr and "--json" in stderr:
        entry.update(status="not machine-readable yet", tail=_tail(stdout + stderr, 5))
    elif rc == 0:
        entry.update(status="not machine-readable yet", tail=_tail(stdout, 30))
    else:
        entry.update(status="failed" if rc is not None else "timed out", tail=_tail(stdout + "\n" + stderr))
    print(f"   {entry['status']} in {entry['seconds']:.0f} s (load after {entry['load_after'][0]:.2f})", flush=True)
    return entry


def _text(data: bytes | str | None) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


@contextlib.contextmanager
def bench_lock(path: str = LOCK):
    """Hold the shared benchmark lock (the same file `flock` uses) for the whole run."""
    with open(path, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for {path} (another benchmark is running)", flush=True)
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def run(benchmarks=BENCHMARKS, *, out: Path, mode: str = "quick", scripts: Path = ROOT / "benchmarks",
        lock: str | None = LOCK) -> dict:
    """Run ``benchmarks`` in turn, rewriting ``out`` after each; return the whole record."""
    result = {"date": dt.datetime.now().astimezone().isoformat(timespec="seconds"), "mode": mode,
              "command": "make bench", "machine": _record.machine(), "benchmarks": [],
              "left_out": dict(LEFT_OUT)}
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with (bench_lock(lock) if lock else contextlib.nullcontext()), \
            tempfile.TemporaryDirectory(prefix="bench_all_") as tmp:
        result["machine"]["load_average_at_start"] = list(os.getloadavg())
        for bench in benchmarks:
            result["benchmarks"].append(run_one(bench, mode, scripts, Path(tmp)))
            result["total_s"] = round(time.monotonic() - start, 1)
            out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    result["machine"]["load_average_at_end"] = list(os.getloadavg())
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench.json"))
    parser.add_argument("--only", default=None, help="comma-separated names, e.g. infer_vs_monai,train_peers")
    parser.add_argument("--smoke", action="store_true", help="run every script at its tiny --smoke size instead")
    args = parser.parse_args()
    names = [b.name for b in BENCHMARKS]
    only = args.only.split(",") if args.only else names
    if unknown := sorted(set(only) - set(names)):
        print(f"error: unknown benchmark(s) {', '.join(unknown)}; valid: {', '.join(names)}", file=sys.stderr)
        return 2
    mode = "smoke" if args.smoke else "quick"
    result = run([b for b in BENCHMARKS if b.name in only], out=Path(args.out), mode=mode,
                 lock=None if args.smoke else LOCK)  # smoke figures mean nothing: no need to hold the lock
    statuses = [b["status"] for b in result["benchmarks"]]
    print(f"wrote {args.out}: {statuses.count('ok')}/{len(statuses)} ok in {result['total_s']:.0f} s")
    return 0 if all(s in ("ok", "not machine-readable yet") for s in statuses) else 1


if __name__ == "__main__":
    raise SystemExit(main())
