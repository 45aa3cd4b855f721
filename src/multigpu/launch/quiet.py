"""torch's c10d warning about reverse DNS, left out of a job's output (runs in the launcher).

Every TCP connection torch's c10d makes (a launcher's or a rank's store) formats its peer's address with
``getnameinfo``; where the host's resolver does not answer (hosts without reverse DNS, a cluster's isolated
network), each prints, in C++ on standard error::

    [W1129 05:59:01.786095141 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3

once per launcher and rank and per connection: noise in every log that says nothing the user can act on (the
connection is made all the same, with the numeric address). Two places drop it, and nothing else:

* the ranks' lines the launcher copies to its console (:func:`filtered_tails`: torch's ``TailLog`` with a line
  filter, on a job whose output is teed, which every job of several nodes is); the ranks' own log files keep
  every line;
* the launcher's own stores, while one connects (:func:`without_noise`: standard error is read through a pipe for
  the moment of the connection, and every other line is written back).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterator

__all__ = ["NOISE", "filtered_tails", "is_noise", "without_noise"]

NOISE = re.compile(r"\[c10d\] The hostname of the client socket cannot be retrieved")
"""torch's line (torch/csrc/distributed/c10d/socket.cpp, ``formatSockAddr``)."""


def is_noise(line: str) -> bool:
    return NOISE.search(line) is not None


@contextlib.contextmanager
def without_noise() -> Iterator[None]:
    """Standard error (the file descriptor, where C++ writes) without torch's reverse-DNS line for the block.

    Meant for a moment (a store connecting); what else is written meanwhile comes out when the block ends."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no standard error to speak of
        yield
        return
    read_end, write_end = os.pipe()
    chunks: list[bytes] = []

    def drain() -> None:
        while data := os.read(read_end, 65536):
            chunks.append(data)

    reader = threading.Thread(target=drain, name="multigpu-stderr-filter", daemon=True)
    reader.start()
    os.dup2(write_end, 2)
    os.close(write_end)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError, OSError):
            sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last writer closes: the reader ends
        os.close(saved)
        reader.join(timeout=5)
        os.close(read_end)
        text = b"".join(chunks).decode(errors="replace")
        kept = "".join(line for line in text.splitlines(keepends=True) if not is_noise(line))
        if kept:
            with contextlib.suppress(OSError):
                os.write(2, kept.encode())


@contextlib.contextmanager
def filtered_tails() -> Iterator[None]:
    """torch's agent copies the teed ranks' lines to the console without torch's reverse-DNS line, for the block
    (its ``TailLog``, given a line filter; the user's own ``--local-ranks-filter`` is kept as it was)."""
    from torch.distributed.elastic.multiprocessing import api

    original = api.TailLog

    class QuietTailLog(original):
        def __init__(self, *args, log_line_filter=None, **kwargs):
            inner = log_line_filter or (lambda _line: True)
            super().__init__(*args, log_line_filter=lambda line: not is_noise(line) and inner(line), **kwargs)

    api.TailLog = QuietTailLog
    try:
        yield
    finally:
        api.TailLog = original
