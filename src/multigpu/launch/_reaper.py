"""Stops what a job's workers started when the launcher itself is killed (runs beside the launcher, stdlib only).

A SIGKILLed launcher runs no code, and its workers die by ``PR_SET_PDEATHSIG``
(``_worker.py``), but the processes *they* started (a ``subprocess`` child, a
daemon that called ``setsid``) are re-parented to init and run on. So
:func:`multigpu.launch.processes.job_processes` starts this tiny process,
``python -I _reaper.py TOKEN [FOLDER...]``, in a session of its own (Ctrl-C on the terminal
does not reach it), with its stdin the read end of a pipe only the launcher
writes to:

* the launcher ends normally: it has stopped the leftovers itself, writes
  ``done`` and closes the pipe; this process exits;
* the launcher dies (the pipe closes without ``done``): every process of this
  user whose environment carries ``MULTIGPU_JOB_TOKEN=TOKEN`` (the launcher sets
  it for the workers, so everything they start inherits it) gets SIGTERM, then
  SIGKILL after ``GRACE_S``; the sweep repeats until no such process is left, so
  one forked meanwhile is caught too. Then it removes the launcher's private
  folders (``FOLDER...``: the stores' 0700 folders).

A process that clears its environment (``env -i``) is not found; that is the
limit. Run by path, before anything of multigpu: it imports only the standard library.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

TOKEN_VAR = "MULTIGPU_JOB_TOKEN"
DONE = b"done"
GRACE_S = 3.0
_ROUNDS = 20


def carriers(token: str, proc: str = "/proc") -> list[int]:
    """Pids of this user's processes whose environment holds ``MULTIGPU_JOB_TOKEN=token`` (never this one)."""
    needle = f"{TOKEN_VAR}={token}".encode()
    found = []
    for name in os.listdir(proc):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(os.path.join(proc, name, "environ"), "rb") as fh:
                if needle in fh.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue  # gone, or another user's
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def sweep(token: str, grace_s: float = GRACE_S) -> int:
    """SIGTERM every carrier, SIGKILL those left after ``grace_s``, until none is left; returns how many."""
    seen: set[int] = set()
    for _ in range(_ROUNDS):
        pids = carriers(token)
        if not pids:
            break
        seen.update(pids)
        _signal(pids, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and carriers(token):
            time.sleep(0.05)
        _signal(carriers(token), signal.SIGKILL)
        time.sleep(0.05)
    return len(seen)


def main(token: str, folders: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the launcher's end of the pipe ends this process
    said = b""
    while chunk := os.read(0, 64):
        said += chunk
    if said != DONE:
        sweep(token)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
