"""One run per run directory: the lock, the "already used" rule, the up-front disk checks (in the launcher).

Two runs writing one folder corrupt each other (one's temporary-file cleanup
deletes the other's file, ``metrics.jsonl`` holds both, ``run.json`` shows the
other's config, checkpoints of different models share a manifest). So:

* a run directory that already holds something is refused unless the command
  continues it (``--resume``): :func:`refuse_used` (``bench`` and ``verify``
  refuse any non-empty output folder the same way). On several nodes sharing
  one folder every node writes there, so the rule is left to the lock;
* while a run is on, its launcher holds ``<run_dir>/.lock`` (``.lock.node<K>``
  on node K of a multi-node job), a small JSON file with its pid, host, process
  start time and command: :func:`hold`. A second run on the same folder is
  refused in one line naming the owner. A lock whose process is gone (same host,
  pid not running, or running but started at another time: the pid was reused)
  is stale: it is replaced, with a note. A lock from another host cannot be
  checked: it is refused, and the message says which file to remove;
* before anything is written, the file system must have :data:`MIN_FREE_BYTES`
  free and the lock must be writable; otherwise one line names the folder and
  the cause (disk full, read-only file system, permission), exit 2.

All of these run before any worker starts.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError, OutputError
from multigpu.files import cannot_write, create_exclusive, describe_os_error

__all__ = ["LOCK", "MIN_FREE_BYTES", "cannot_create", "check_free_space", "check_writable", "create", "hold", "lock_name",
           "refuse_run_folder",
           "refuse_used"]

LOCK = ".lock"
"""The lock file of node 0 (node K > 0: ``.lock.node<K>``)."""

MIN_FREE_BYTES = 16 << 20
"""Free space a run directory's file system must have at the start (logs, run.json, metrics, samples)."""


def lock_name(node_rank: int = 0) -> str:
    return LOCK if node_rank == 0 else f"{LOCK}.node{node_rank}"


def _holds_a_file(path: Path) -> bool:
    if not path.is_dir():
        return True
    return any(files for _, _, files in os.walk(path))


def _entries(folder: Path) -> list[str]:
    """What the folder holds besides lock files and empty sub-folders (sorted), or [] when it does not exist."""
    if not folder.is_dir():
        return []
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                  if not p.name.startswith(LOCK) and _holds_a_file(p))


def refuse_used(folder: str | Path, flag: str = "--run-dir", *, hint: str = "give a new folder") -> None:
    """Raise a one-line ConfigError when ``folder`` holds any file (lock files aside; empty folders hold nothing).

    Args:
        flag: How the user named the folder (``--run-dir``, ``-o``), for the message.
        hint: The valid choice, for the message.
    """
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {folder} is a file, not a folder; {hint}")
    held = _entries(path)
    if held:
        shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"{flag} {folder} already exists and is not empty ({shown}); {hint}")


def refuse_ended(folder: str | Path, node_rank: int, alive: Callable[[], bool] = lambda: False) -> None:
    """On a node other than 0 of a job of several nodes, not resuming: raise a one-line ConfigError when ``folder``
    holds a run that has ended (its ``summary.json``, which rank 0 writes when an attempt ends) and the job's
    rendezvous store does not answer (``alive()``: node 0's launcher, where it lives, is gone with the job). That
    node arrived after the job's end, and waited for the whole join timeout saying nothing. An elastic job whose
    worker group ended an attempt has a summary.json and a store that answers: a node joining it is let in."""
    summary = Path(folder) / "summary.json"
    try:
        written = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(summary.stat().st_mtime))
    except OSError:
        return
    if alive():
        return
    raise ConfigError(f"node {node_rank} arrived after the job in {folder} had ended (its summary.json, written "
                      f"{written}): a node that arrives after the end has nothing to join; valid: --resume auto on "
                      "every node to continue it, or a new --run-dir")


def check_free_space(folder: str | Path, flag: str = "--run-dir") -> None:
    """Refuse a run whose folder's file system has less than :data:`MIN_FREE_BYTES` free."""
    from multigpu.units import format_bytes

    probe = Path(folder).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return  # read-only: its first write says so (EROFS), which is the reason, not how full it is
    except OSError:
        return  # no figure: the first write will say what is wrong
    if free < MIN_FREE_BYTES:
        raise OutputError(f"{flag} {folder}: only {format_bytes(free)} free on its file system, and a run writes "
                          f"logs, metrics and checkpoints there; valid: free some space (at least "
                          f"{format_bytes(MIN_FREE_BYTES)}), or give a folder on another disk")


def check_writable(folder: str | Path, flag: str = "--log-dir") -> None:
    """Refuse in one line, writing nothing, a folder that is a file or that cannot be created or written: its
    nearest existing folder is on a read-only file system, or not writable by this user."""
    path = Path(folder)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {folder} is a file, not a folder; valid: a folder (it is created if missing)")
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        return  # no figure: the first write will say what is wrong
    code = errno.EROFS if read_only else None if os.access(probe, os.W_OK | os.X_OK) else errno.EACCES
    if code is not None:
        cause = OSError(code, os.strerror(code))
        if path.is_dir():
            raise OutputError(f"cannot write into {flag} {folder}: {describe_os_error(cause)}")
        raise cannot_create(path, cause, flag)


def refuse_run_folder(folder: str | Path, flag: str = "--log-dir") -> None:
    """Refuse (one-line ConfigError) a folder that is a workload run's (its ``run.json`` names a workload): a plain
    script launched with its logs there would replace that ``run.json``, which the run's resume reads."""
    import json

    try:
        data = json.loads((Path(folder) / "run.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return
    workload = data.get("workload") if isinstance(data, dict) else None
    if workload:
        raise ConfigError(f"{flag} {folder} is the run folder of a {workload} run (its run.json would be replaced); "
                          f"valid: another {flag} (a run's own logs are in its logs/ folder)")


def cannot_create(path: Path, exc: OSError, flag: str = "--run-dir") -> OutputError:
    return OutputError(f"could not create {flag} {path}: {describe_os_error(exc)}")


def create(path: Path, flag: str = "--run-dir") -> None:
    """``mkdir -p`` with a one-line error naming the folder and the cause; a new last folder is this user's only
    (0700: its logs, configs and checkpoints are nobody else's to read), one that exists keeps its mode."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise cannot_create(path, exc, flag) from exc


# ----------------------------------------------------------------------------- the lock
def _me() -> dict[str, Any]:
    import psutil

    return {"pid": os.getpid(), "host": socket.gethostname(), "started": psutil.Process().create_time(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(["multigpu", *sys.argv[1:6]])[:200]}


def _alive(owner: dict[str, Any]) -> bool | None:
    """True: the owner runs; False: it is gone (stale lock); None: cannot tell (another host)."""
    import psutil

    if owner.get("host") != socket.gethostname():
        return None
    try:
        proc = psutil.Process(int(owner["pid"]))
        return abs(proc.create_time() - float(owner.get("started", 0))) < 1.0  # else the pid was reused
    except (psutil.Error, KeyError, TypeError, ValueError):
        return False


def _read(lock: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(lock.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def _try_take(lock: Path, me: dict[str, Any]) -> bool:
    """Create ``lock`` holding ``me``, atomically and only if it does not exist (written aside in a folder of this
    write's own, then hard-linked: no guessable temporary name where another user could plant a link)."""
    try:
        return create_exclusive(lock, json.dumps(me).encode())
    except OSError as exc:
        raise cannot_write(lock, exc) from exc


def _acquire(folder: Path, node_rank: int, flag: str) -> Path:
    lock = folder / lock_name(node_rank)
    me = _me()
    for _ in range(3):
        if _try_take(lock, me):
            return lock
        if lock.is_dir() or (lock.exists() and not lock.is_file()):  # never ours: not taken over, not removed
            kind = "a folder" if lock.is_dir() else "not a file"
            raise ConfigError(f"{flag} {folder}: {lock} is {kind}, not the run's lock file; valid: remove that "
                              f"{'folder' if lock.is_dir() else 'entry'}, or another {flag}")
        owner = _read(lock)
        if owner is None:
            continue  # released between the two calls: try again
        alive = _alive(owner) if owner else False
        if alive is False:
            print(f"multigpu: {lock} was left by pid {owner.get('pid', '?')}, which is no longer running; "
                  "taking it over", file=sys.stderr, flush=True)
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
            continue
        where = "on this machine" if alive else f"on host {owner.get('host')}"
        what = f" ({owner['command']})" if owner.get("command") else ""
        remove = "" if alive else f"; if that run is over, remove {lock}"
        raise ConfigError(f"{flag} {folder} is in use by another run: pid {owner.get('pid')} {where}{what} since "
                          f"{owner.get('since', '?')}; valid: wait for it to end, or give another {flag}{remove}")
    raise ConfigError(f"{flag} {folder}: could not take {lock} (other runs keep taking it); give another {flag}")


def _release(lock: Path) -> None:
    owner = _read(lock)
    if owner and owner.get("pid") == os.getpid():
        with contextlib.suppress(OSError):
            lock.unlink()


@contextlib.contextmanager
def hold(folder: str | Path, *, node_rank: int = 0, fresh_only: bool = False, flag: str = "--run-dir",
         hint: str = "give a new folder") -> Iterator[Path]:
    """Create ``folder`` if needed, hold its lock for the ``with`` block, release it after.

    Args:
        node_rank: Which node's lock (each node of a multi-node job on a shared folder holds its own).
        fresh_only: Refuse the folder unless it is empty (checked again under the lock, so two runs
            started at once cannot both pass the early check).
        flag, hint: For the messages.

    Raises:
        ConfigError: another live run holds it, or (``fresh_only``) it is not empty.
        OutputError: the folder or its lock cannot be written (read-only, permission, disk full).
    """
    path = Path(folder)
    create(path, flag)
    lock = _acquire(path, node_rank, flag)
    try:
        if fresh_only:
            refuse_used(path, flag, hint=hint)
        yield path
    finally:
        _release(lock)
