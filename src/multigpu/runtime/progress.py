"""The last step each rank finished, readable by its launcher while the rank runs and after it died.

A rank's step count lives in a file of 24 bytes (its pid, its rank, the steps finished), one per local rank, under :func:`folder` (in the
launcher's stacks folder, one per node: named by the host and the launcher's pid), mapped into the rank's memory: a step costs one store into that memory, never
a system call, and the count survives the rank (a SIGKILL included). The launcher reads the files of its own
ranks (:func:`read`) and sends them with its heartbeat to the other nodes, so that a lost node's last steps are
known to the nodes that survive it (:mod:`multigpu.launch.nodes`).

:meth:`multigpu.run.Run.end_step` calls :func:`finished` after every step; outside a launch it does nothing.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
from pathlib import Path

from multigpu import envvars

__all__ = ["finished", "folder", "read"]

_FORMAT = "<qqq"  # pid, rank, steps finished
_SIZE = struct.calcsize(_FORMAT)
_map: mmap.mmap | None = None
_opened_for: int | None = None  # the pid the map was made for: a forked child makes its own


def folder(stacks_dir: str, launcher_pid: int | str) -> str:
    """Where the ranks of the launcher ``launcher_pid`` on this host keep their counts (the launcher makes it)."""
    return os.path.join(stacks_dir, "steps", f"{socket.gethostname()}-{launcher_pid}")


def _open(local_rank: int) -> mmap.mmap | None:
    stacks, launcher = os.environ.get(envvars.STACKS_DIR), os.environ.get(envvars.LAUNCHER_PID)
    if not stacks or not launcher:
        return None
    where = folder(stacks, launcher)
    if not os.path.isdir(where):
        return None  # one node: the launcher reads no counts
    try:
        fd = os.open(os.path.join(where, f"local{local_rank}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return None
    try:
        os.ftruncate(fd, _SIZE)
        return mmap.mmap(fd, _SIZE)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def finished(step: int) -> None:
    """This rank has finished ``step`` steps (cheap: a store into shared memory after the first call)."""
    global _map, _opened_for
    pid = os.getpid()
    if _opened_for != pid:
        _opened_for, _map = pid, _open(int(os.environ.get("LOCAL_RANK", "0")))
    if _map is not None:
        struct.pack_into(_FORMAT, _map, 0, pid, int(os.environ.get("RANK", "0")), int(step))


def read(folder: str | Path) -> dict[int, int]:
    """{rank: steps finished} of the ranks that wrote under ``folder`` (pure reading; a rank that finished no
    step yet is absent)."""
    found: dict[int, int] = {}
    for path in Path(folder).glob("local*"):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if len(data) == _SIZE:
            pid, rank, step = struct.unpack(_FORMAT, data)
            if pid:
                found[rank] = step
    return found
