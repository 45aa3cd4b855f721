"""Where each rank stood when the job ended: parse the stacks the workers dumped (runs in the launcher).

Every worker's wrapper (``_worker.py``) writes all its threads' Python stacks to
``<stacks dir>/rank<R>.txt`` when it receives SIGTERM (torch's agent sends it
to the surviving workers after a failure) or SIGUSR1. This module turns those
``faulthandler`` dumps into one line per rank: the call it was in and the
user code that made it.
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FRAME", "RankPosition", "is_library", "parse_faulthandler", "read_positions"]

# faulthandler writes 'File "f", line 3 in g'; tracebacks write 'File "f", line 3, in g'
FRAME = re.compile(r'^\s*File "(?P<file>.+)", line (?P<line>\d+),? in (?P<func>.+)$')
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])
_LIBRARY_DIRS = tuple(
    d for d in {_PACKAGE_DIR, sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("purelib")} if d
)


@dataclass(frozen=True)
class RankPosition:
    rank: int
    call: str
    """Innermost Python frame: ``func (file:line)``."""
    user_frame: str | None
    """Innermost frame outside multigpu, torch and the standard library, if any."""

    def describe(self) -> str:
        where = f", called from {self.user_frame}" if self.user_frame and self.user_frame not in self.call else ""
        return f"rank {self.rank}: in {self.call}{where}"


def _short(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def parse_faulthandler(text: str) -> list[tuple[str, int, str]] | None:
    """The frames (file, line, function), innermost first, of the thread that took the signal."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", text.strip())
    chosen = next((b for b in blocks if b.startswith("Current thread")), blocks[0] if blocks else "")
    frames = []
    for line in chosen.splitlines():
        m = FRAME.match(line)
        if m:
            frames.append((m["file"], int(m["line"]), m["func"].strip()))
    return frames or None


def is_library(path: str) -> bool:
    """True for frames of multigpu, installed packages, the standard library and frozen modules."""
    return path.startswith("<") or any(path.startswith(d) for d in _LIBRARY_DIRS)


_WRAPPER = str(Path(__file__).with_name("_worker.py"))
ENDED = "multigpu's worker wrapper (its script had ended)"
"""Where a rank stood that was stopped after its script had returned or raised (the wrapper was leaving)."""


def _script_ended(frames: list[tuple[str, int, str]]) -> bool:
    """The wrapper's frames with no script under them: runpy, which runs the script, is no longer on the stack."""
    files = [os.path.realpath(f) if not f.startswith("<") else f for f, _, _ in frames]
    return os.path.realpath(_WRAPPER) in files and not any("runpy" in f for f in files)


def read_positions(folder: str | Path, skip: set[int] = frozenset()) -> list[RankPosition]:
    """One ``RankPosition`` per rank that left a non-empty dump in ``folder`` (ranks in ``skip`` left out)."""
    out = []
    for path in sorted(Path(folder).glob("rank*.txt"), key=lambda p: int(p.stem[4:] or 0)):
        rank = int(path.stem[4:] or 0)
        if rank in skip:
            continue
        frames = parse_faulthandler(path.read_text(errors="replace"))
        if not frames:
            continue
        if _script_ended(frames):
            out.append(RankPosition(rank, ENDED, None))
            continue
        file, line, func = frames[0]
        user = next((f"{_short(f)}:{n}" for f, n, _ in frames if not is_library(f)), None)
        out.append(RankPosition(rank, f"{func} ({_short(file)}:{line})", user))
    return out
