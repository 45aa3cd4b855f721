"""A per-rank watchdog: a rank that makes no progress for ``stall_s`` seconds ends the job, saying where.

Runs inside each rank, in a daemon thread started by :func:`multigpu.init` when
the run context has ``stall_timeout_s`` (launcher flag ``--stall-timeout-s``). Progress is a
:func:`heartbeat`: every multigpu collective and every ``StepMeter`` step beats.
When the silence exceeds ``stall_s``, the watchdog writes every thread's stack
to ``$MULTIGPU_STACKS_DIR`` (or stderr), records an error naming this rank, the
last thing it did and for how long, in torch's error file (so the launcher's
summary shows it), and exits the process with code 3. The launcher then stops
the other ranks, whose own stacks are dumped too.

Collective timeouts (``timeout_s``) cover a rank waiting on another; this covers
every rank stuck at once, or a rank stuck before its first collective.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback

from multigpu import envvars
from multigpu.errors import StallError

__all__ = ["heartbeat", "start", "stop"]

_LAST_BEAT = time.monotonic()
_LAST_WHAT = "start-up"
_THREAD: threading.Thread | None = None
_STOP = threading.Event()


def heartbeat(what: str) -> None:
    """Record progress (``what``: e.g. "barrier()" or "step 12"). Cheap: two assignments."""
    global _LAST_BEAT, _LAST_WHAT
    _LAST_BEAT = time.monotonic()
    _LAST_WHAT = what


_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LIBRARY_PREFIXES = tuple({sys.prefix, sys.base_prefix, sys.exec_prefix, _OWN_DIR})


def _main_thread_frames() -> list[traceback.FrameSummary]:
    """The main thread's stack, innermost first."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    return list(reversed(traceback.extract_stack(frame))) if frame is not None else []


def _where(frames: list[traceback.FrameSummary]) -> str:
    user = next((f for f in frames if not f.filename.startswith(_LIBRARY_PREFIXES + ("<",))), None)
    chosen = user or (frames[0] if frames else None)
    return f"{chosen.filename}:{chosen.lineno} in {chosen.name}" if chosen else "an unknown place"


def _write_stack(path: str, frames: list[traceback.FrameSummary]) -> None:
    """The main thread's stack in faulthandler's format (what the launcher parses), then all threads."""
    with open(path, "w") as fh:
        fh.write(f"Current thread 0x{threading.main_thread().ident:016x} (most recent call first):\n")
        fh.writelines(f'  File "{f.filename}", line {f.lineno} in {f.name}\n' for f in frames)
        fh.write("\nAll threads, as faulthandler sees them (the watchdog's own thread is the current one):\n")
        fh.flush()
        faulthandler.dump_traceback(file=fh, all_threads=True)


def _fire(rank: int, stall_s: float) -> None:
    silent = time.monotonic() - _LAST_BEAT
    frames = _main_thread_frames()
    message = (
        f"rank {rank} made no progress for {silent:.0f}s (stall timeout {stall_s:g}s) and is at {_where(frames)}; "
        f"its last progress was {_LAST_WHAT}"
    )
    folder = os.environ.get(envvars.STACKS_DIR)
    if folder:
        os.makedirs(folder, exist_ok=True)
        _write_stack(os.path.join(folder, f"rank{rank}.txt"), frames)
    print(f"multigpu watchdog: {message}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors.error_handler import ErrorHandler

        try:
            raise StallError(message)
        except StallError as exc:
            ErrorHandler().record_exception(exc)
    os._exit(3)


def _watch(rank: int, stall_s: float, poll_s: float) -> None:
    while not _STOP.wait(poll_s):
        if time.monotonic() - _LAST_BEAT > stall_s:
            _fire(rank, stall_s)


def start(rank: int, stall_s: float) -> None:
    """Start watching this rank (idempotent)."""
    global _THREAD
    heartbeat("init()")
    if _THREAD is not None and _THREAD.is_alive():
        return
    _STOP.clear()
    _THREAD = threading.Thread(
        target=_watch, args=(rank, stall_s, min(1.0, stall_s / 4)), name="multigpu-watchdog", daemon=True
    )
    _THREAD.start()


def stop() -> None:
    """Stop watching (``shutdown()`` calls this)."""
    global _THREAD
    _STOP.set()
    if _THREAD is not None:
        _THREAD.join(timeout=2)
    _THREAD = None
