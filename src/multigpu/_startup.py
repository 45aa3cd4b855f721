"""A Ctrl-C while the ``multigpu`` command starts is one line, not a traceback (outside the ranks).

``python -m multigpu`` and the ``multigpu`` script import this package, and with it torch, before
:func:`multigpu.cli.main` runs: seconds in which a Ctrl-C used to end in a traceback through the
imports. When this process is that command, the first line of the package's import installs a SIGINT
handler that says ``error: interrupted`` and exits 130, as the command does once running; ``main``
puts Python's own handler back (:func:`restore`). Likewise torch failing to load under ``ulimit -v``
(``RLIMIT_AS``: "failed to map segment from shared object") is one line naming the limit, exit 2, and a limit below
what loading takes (:data:`MIN_ADDRESS_SPACE`) is that line before anything is loaded. Any
other importer (a user's script, a rank, a notebook) keeps its SIGINT handling and excepthook untouched.
"""

from __future__ import annotations

import os
import resource  # now: under a tight ulimit -v, no library may load later
import signal
import sys
import threading


def _is_command_line() -> bool:
    """Whether this process is ``multigpu ...`` or ``python [-flags] -m multigpu ...``."""
    argv = list(getattr(sys, "orig_argv", None) or [])
    if "-m" in argv[1:]:
        at = argv.index("-m", 1)
        return argv[at + 1:at + 2] == ["multigpu"]
    return bool(sys.argv) and os.path.basename(sys.argv[0]) == "multigpu"


def _interrupted(signum, frame) -> None:
    try:
        os.write(2, b"error: interrupted\n")
    finally:
        os._exit(130)


def _address_space_words(exc: BaseException) -> str | None:
    """What to say when ``exc`` is an import refused memory under ``RLIMIT_AS`` (``ulimit -v``), else None."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    text = str(exc).lower()
    refused = isinstance(exc, MemoryError) or "failed to map segment" in text or "cannot allocate memory" in text
    if soft == resource.RLIM_INFINITY or not refused:
        return None
    first = (str(exc).strip().splitlines() or [""])[0][:160]
    what = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return (f"multigpu cannot load torch under ulimit -v (RLIMIT_AS) of {soft / 2**20:,.0f} MiB ({what}); valid: ulimit -v unlimited (a cgroup or the scheduler's --mem caps real memory), or a limit "
            "of a few GiB (a torch process maps about 0.7 GiB of address space before it holds any data)")


MIN_ADDRESS_SPACE = 600 << 20
"""The least ``ulimit -v`` (``RLIMIT_AS``, soft) under which the command starts: loading torch (with NumPy and OpenBLAS)
maps more than this before it holds any data. Below it the load fails in ways no handler sees: measured with torch
2.13 on Linux, 390 MiB aborted in C++ (``std::bad_alloc``, exit 134), 488 MiB ended in OpenBLAS ("Memory allocation
still failed after 10 retries", exit 1), others in a MemoryError or "failed to map segment"; 635 MiB ran a job."""


def _too_small_words() -> str | None:
    """The line for a ``ulimit -v`` below :data:`MIN_ADDRESS_SPACE`, else None (checked before anything loads)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft >= MIN_ADDRESS_SPACE:
        return None
    return (f"multigpu cannot load torch under ulimit -v (RLIMIT_AS) of {soft / 2**20:,.0f} MiB (loading torch maps "
            f"more than {MIN_ADDRESS_SPACE >> 20} MiB of address space); valid: ulimit -v unlimited (a cgroup or the "
            "scheduler's --mem caps real memory), or a limit of a few GiB (a torch process maps about 0.7 GiB of "
            "address space before it holds any data)")


def _excepthook(kind, value, traceback) -> None:
    words = _address_space_words(value)
    if words is None:
        sys.__excepthook__(kind, value, traceback)
        return
    try:
        os.write(2, f"error: {words}\n".encode())
    finally:
        os._exit(2)


def install() -> None:
    if not (_is_command_line() and threading.current_thread() is threading.main_thread()):
        return
    words = _too_small_words()  # before torch: below it, its load can abort where no handler runs
    if words is not None:
        os.write(2, f"error: {words}\n".encode())
        os._exit(2)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored (`cmd &`)
        signal.signal(signal.SIGINT, _interrupted)
    if sys.excepthook is sys.__excepthook__:  # torch failing to load under ulimit -v: one line, not a traceback
        sys.excepthook = _excepthook


def restore() -> None:
    """Python's KeyboardInterrupt again (``main`` turns it into its one line and exit code 130), and its own
    report of an uncaught exception."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.excepthook is _excepthook:
        sys.excepthook = sys.__excepthook__


install()
