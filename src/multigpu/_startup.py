"""A Ctrl-C while the ``multigpu`` command starts is one line, not a traceback (outside the ranks).

``python -m multigpu`` and the ``multigpu`` script import this package, and with it torch, before
:func:`multigpu.cli.main` runs: seconds in which a Ctrl-C used to end in a traceback through the
imports. When this process is that command, the first line of the package's import installs a SIGINT
handler that says ``error: interrupted`` and exits 130, as the command does once running; ``main``
puts Python's own handler back (:func:`restore`). Any other importer (a user's script, a rank, a
notebook) keeps its SIGINT handling untouched.
"""

from __future__ import annotations

import os
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


def install() -> None:
    if (_is_command_line() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
        signal.signal(signal.SIGINT, _interrupted)


def restore() -> None:
    """Python's KeyboardInterrupt again (``main`` turns it into its one line and exit code 130)."""
    if signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)


install()
