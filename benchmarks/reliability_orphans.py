"""Which processes outlive their launcher: `multigpu launch` vs plain torchrun.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/reliability_orphans.py

Three scenarios, each run under both launchers with 2 CPU workers of the same
plain script (no torch.distributed: the launchers are compared, not the ranks):

* ``SIGKILL``: each worker records its pid and sleeps; the launcher is
  SIGKILLed once both have started (``kill -9``, the OOM killer, a lost job step);
* ``SIGTERM in start-up``: 4 workers, the launcher's process-start call slowed
  down by 1 s per worker (``subprocess.Popen`` wrapped in this script, the same
  for both), SIGTERM once the first worker exists (``timeout``, a scheduler);
* ``rank forks``: each worker starts a child and a daemon (``setsid``), then
  exits 0; the job succeeds.

For each it prints how many of the processes the job started are still running
1 s, 5 s and 15 s after the launcher ended. Every survivor is SIGKILLed at the
end of the scenario.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
CHECKS_S = (1, 5, 15)

SLEEPER = """import os, sys, time
open(os.path.join(sys.argv[1], "pid" + os.environ["RANK"]), "w").write(str(os.getpid()))
time.sleep(600)
"""

FORKER = """import os, subprocess, sys
for name, new_session in (("child", False), ("daemon", True)):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=new_session)
    open(os.path.join(sys.argv[1], name + os.environ["RANK"]), "w").write(str(proc.pid))
"""

SLOW_START = """import subprocess, sys, time
_start = subprocess.Popen.__init__
def _slow(self, *a, **k):
    _start(self, *a, **k)
    time.sleep(1.0)
subprocess.Popen.__init__ = _slow
"""

LAUNCHERS = {
    "torchrun": (["-m", "torch.distributed.run", "--standalone"],
                 "from torch.distributed.run import main; main(sys.argv[1:])"),
    "multigpu launch": (["-m", "multigpu", "launch"],
                        "from multigpu.cli import main; sys.exit(main(['launch', *sys.argv[1:]]))"),
}


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _descendants(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _survivors(pids: set[int], ended: float) -> list[int]:
    counts = []
    for at in CHECKS_S:
        time.sleep(max(0.0, ended + at - time.monotonic()))
        counts.append(len(_alive(pids)))
    for pid in _alive(pids):
        os.kill(pid, signal.SIGKILL)
    return counts


def _wait_files(folder: Path, prefix: str, count: int, proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 120
    while len(list(folder.glob(f"{prefix}*"))) < count:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"the job ended or stalled before {count} {prefix} files (exit {proc.poll()})")
        time.sleep(0.1)
    return [int(p.read_text()) for p in folder.glob(f"{prefix}*")]


def _sigkill(name: str, scripts: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="orphans_"))
    args, _ = LAUNCHERS[name]
    proc = subprocess.Popen([sys.executable, *args, "--nproc-per-node", "2", str(scripts / "sleeper.py"), str(folder)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids = set(_wait_files(folder, "pid", 2, proc))
    proc.kill()
    proc.wait()
    return {"started": len(pids), "left": _survivors(pids, time.monotonic())}


def _sigterm_in_start_up(name: str, scripts: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="orphans_"))
    _, entry = LAUNCHERS[name]
    code = SLOW_START + entry
    proc = subprocess.Popen([sys.executable, "-c", code, *(["--standalone"] if name == "torchrun" else []),
                             "--nproc-per-node", "4", str(scripts / "sleeper.py"), str(folder)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen: set[int] = set()
    deadline = time.monotonic() + 120
    while not seen and time.monotonic() < deadline:
        seen = _descendants(proc.pid)
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    while proc.poll() is None:
        seen |= _descendants(proc.pid)
        time.sleep(0.02)
    return {"started": len(seen), "left": _survivors(seen, time.monotonic()), "exit": proc.returncode}


def _rank_forks(name: str, scripts: Path) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="orphans_"))
    args, _ = LAUNCHERS[name]
    # no pipes: a survivor holding them open would keep a reader waiting
    proc = subprocess.run([sys.executable, *args, "--nproc-per-node", "2", str(scripts / "forker.py"), str(folder)],
                          cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    pids = {int(p.read_text()) for p in [*folder.glob("child*"), *folder.glob("daemon*")]}
    return {"started": len(pids), "left": _survivors(pids, time.monotonic()), "exit": proc.returncode}


def main() -> None:
    scripts = Path(tempfile.mkdtemp(prefix="orphan_scripts_"))
    (scripts / "sleeper.py").write_text(SLEEPER)
    (scripts / "forker.py").write_text(FORKER)
    scenarios = [("SIGKILL", _sigkill), ("SIGTERM in start-up", _sigterm_in_start_up), ("rank forks", _rank_forks)]
    print("| scenario | launcher | exit | processes started | still running after " +
          " / ".join(f"{s} s" for s in CHECKS_S) + " |")
    print("|---|---|---|---|---|")
    for title, scenario in scenarios:
        for name in LAUNCHERS:
            result = scenario(name, scripts)
            exit_code = result.get("exit", -9)
            left = " / ".join(str(n) for n in result["left"])
            print(f"| {title} | {name} | {exit_code} | {result['started']} | {left} |", flush=True)


if __name__ == "__main__":
    main()
