"""How long a 2-rank training job takes to recover from a SIGKILLed rank: ours vs raw torchrun.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/reliability_recovery.py [--steps 40 --kill-after 22]

Each round runs the same small nano-GPT job (2 CPU ranks, checkpoint every 5 steps):

* ``clean``: `multigpu train`, uninterrupted;
* ``ours``: `multigpu train --max-restarts 1`; once rank 0 has logged step
  ``--kill-after``, this script SIGKILLs rank 1 (found by its RANK variable);
* ``torchrun``: the same worker module under plain ``torchrun --max-restarts 1``
  (torch's defaults, c10d rendezvous on a free port), killed the same way;
* ``torchrun+fix``: the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, the
  workaround `multigpu launch` applies when restarts are allowed.

With ``--ctrl-c`` it measures Ctrl-C instead: SIGINT to the launcher after
step ``--kill-after``, with and without ``--checkpoint-on-interrupt``; seconds
until the launcher exits, and whether a valid checkpoint of the last step exists.

It prints, per job: exit code, total wall time, seconds from the kill to the
restarted group's "resuming" line and to its first logged step, the steps that
had to be redone, and whether the final parameters equal the clean run's bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

STEP = re.compile(r"\bstep (\d+)/\d+ \| loss")
ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["batch_size=8", "eval_every=0", "eval_batches=1", "log_every=1", "checkpoint_every=5", "prefetch=0",
          "model.kwargs.n_layer=2", "model.kwargs.n_head=2", "model.kwargs.n_embd=64", "block_size=64", "data.kwargs.max_chars=200000",
          "sample_chars=10"]


def _worker_pid(launcher: int, rank: int) -> int | None:
    import psutil

    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "multigpu.jobs.rank" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


def _run(argv: list[str], env: dict, kill_after: int | None) -> dict:
    """Run one job; SIGKILL rank 1 after step ``kill_after`` is logged. Returns timings (s)."""
    lines: list[tuple[float, str]] = []
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed_at = None
    if kill_after is not None:
        tag = f"step {kill_after}/"
        while proc.poll() is None and not any(tag in text for _, text in lines):
            time.sleep(0.02)
        pid = _worker_pid(proc.pid, 1)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
    proc.wait(timeout=600)
    reader.join(timeout=5)
    errors = [text for _, text in lines if "connectFullMesh failed" in text or text.startswith("error:")]
    result = {"rc": proc.returncode, "total_s": time.monotonic() - start, "tail": (errors or [t for _, t in lines])[-2:]}
    if killed_at is not None:
        resumed = [(t, text) for t, text in lines if t > killed_at and "resuming from" in text]
        if resumed:
            result["to_resume_line_s"] = resumed[0][0] - killed_at
            ckpt = int(resumed[0][1].rsplit("step_", 1)[1][:8])
            before = [int(m[1]) for t, text in lines if t < killed_at and (m := STEP.search(text))]
            result["redone_steps"] = max(before) - ckpt
            after = [t for t, text in lines if t > resumed[0][0] and STEP.search(text)]
            if after:
                result["to_first_step_s"] = after[0] - killed_at
    return result


def _ctrl_c(tmp: Path, env: dict, cfg: list[str], after: int) -> None:
    """SIGINT to the launcher after step ``after``: time to exit, and the checkpoint left behind."""
    import psutil

    from multigpu.checkpoint import CheckpointStore

    print(f"\n{'job':<28} {'rc':>4} {'SIGINT→exit s':>14} {'last checkpoint':>16} {'workers left':>13}")
    for flag in ([], ["--checkpoint-on-interrupt"]):
        run_dir = tmp / f"ctrl_c{len(flag)}"
        proc = subprocess.Popen([sys.executable, "-m", "multigpu", "train", "-f", "nano",
                                 "--nproc-per-node", "2", "--run-dir", str(run_dir), *flag, *cfg, "steps=100000",
                                 "checkpoint_every=0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            if STEP.search(line) and int(STEP.search(line)[1]) >= after:
                break
        workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
        took = time.monotonic() - start
        time.sleep(0.5)
        left = [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        newest = CheckpointStore(run_dir / "checkpoints", warn=print).latest()
        name = "Ctrl-C " + (flag[0] if flag else "(no flag)")
        print(f"{name:<28} {proc.returncode:>4} {took:>14.1f} {newest.name if newest else '-':>16} {len(left):>13}")


def _final(run_dir: Path, steps: int):
    import torch

    path = run_dir / "checkpoints" / f"step_{steps:08d}" / "state.pt"
    return torch.load(path, weights_only=True)["model"] if path.is_file() else None


def _fmt(job: dict, key: str) -> str:
    return f"{job[key]:.1f}" if key in job else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-after", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument("--ctrl-c", action="store_true", help="measure Ctrl-C on the launcher instead of a kill")
    args = ap.parse_args()
    try:
        import psutil  # noqa: F401
    except ImportError:
        print("psutil is needed (pip install psutil)")
        return 1
    import torch

    tmp = Path(tempfile.mkdtemp(prefix="multigpu_recovery_"))
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    base_env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    cfg = [*CONFIG, f"steps={args.steps}"]
    ours = [sys.executable, "-m", "multigpu", "train", "-f", "nano", "--nproc-per-node", "2"]
    if args.ctrl_c:
        _ctrl_c(tmp, base_env, CONFIG, args.kill_after)
        shutil.rmtree(tmp, ignore_errors=True)
        return 0
    rows = []
    for rnd in range(1, args.rounds + 1):
        jobs: dict[str, dict] = {}
        clean_dir = tmp / f"clean{rnd}"
        jobs["clean"] = _run([*ours, "--run-dir", str(clean_dir), *cfg], base_env, None)
        jobs["ours"] = _run([*ours, "--run-dir", str(tmp / f"ours{rnd}"), "--max-restarts", "1", *cfg], base_env,
                            args.kill_after)
        for name, extra in (("torchrun", {}), ("torchrun+fix", {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})):
            run_dir = tmp / f"{name}{rnd}"
            # the same run file `multigpu train` writes, then the rank entry point under plain torchrun
            from multigpu.config import to_dict
            from multigpu.jobs.command import load_workload_config
            from multigpu.jobs.registry import builtin

            run_dir.mkdir(parents=True)
            (run_dir / "run.json").write_text(json.dumps({
                "workload": "train", "config": to_dict(load_workload_config(builtin("train"), "nano", cfg)),
                "run": {"run_dir": str(run_dir)}}))
            argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", "-m", "multigpu.jobs.rank",
                    str(run_dir / "run.json")]
            jobs[name] = _run(argv, {**base_env, **extra}, args.kill_after)
        reference = _final(clean_dir, args.steps)
        for name, job in jobs.items():
            final = _final(tmp / f"{name}{rnd}", args.steps)
            job["identical"] = (final is not None and reference is not None
                                and all(torch.equal(final[k], reference[k]) for k in reference))
            rows.append((rnd, name, job))
    print(f"\n{'round':>5} {'job':<13} {'rc':>4} {'total s':>8} {'kill→resume line s':>19} {'kill→first step s':>18} "
          f"{'redone':>7} {'bit-identical':>14}")
    for rnd, name, job in rows:
        print(f"{rnd:>5} {name:<13} {job['rc']:>4} {job['total_s']:>8.1f} {_fmt(job, 'to_resume_line_s'):>19} "
              f"{_fmt(job, 'to_first_step_s'):>18} {job.get('redone_steps', '-')!s:>7} {job['identical']!s:>14}")
    for rnd, name, job in rows:
        if job["rc"] != 0:
            print(f"round {rnd} {name} failed; its error lines (or last lines):\n  " + "\n  ".join(job["tail"]))
    clean = {rnd: job["total_s"] for rnd, name, job in rows if name == "clean"}
    for rnd, name, job in rows:
        if name != "clean" and job["rc"] == 0:
            print(f"round {rnd}: {name} took {job['total_s'] / clean[rnd]:.2f}× the clean run's wall time")
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"run folders kept in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
