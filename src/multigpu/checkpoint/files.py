"""The file primitives under every checkpoint: atomic, checksummed writes (standard library only).

:class:`multigpu.checkpoint.CheckpointStore` (the one store of every workload) writes through
:func:`atomic_write`: a temporary file in the same folder, written while SHA-256 and the size are
computed over the bytes, flushed, fsynced, renamed into place, the folder fsynced. A failure at any
point (a full disk: ``ENOSPC`` from a write, the fsync or the close) removes the temporary file;
the target is untouched. The errors every checkpoint reader and writer raises live here too.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from multigpu.errors import MultigpuError
from multigpu.files import atomic_path

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "atomic_write",
    "fsync_dir",
    "sha256_file",
]

_CHUNK = 1 << 20


class CheckpointError(MultigpuError):
    """A checkpoint could not be written or read."""


class CheckpointWriteError(CheckpointError):
    """Saving failed (e.g. the disk is full); the previous checkpoints are intact."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated, altered, or not a checkpoint at all."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"checkpoint {path} is unusable: {reason}")
        self.path = Path(path)
        self.reason = reason


class _HashingWriter:
    """A write-only file object that also counts and hashes what passes through it."""

    def __init__(self, fh: BinaryIO):
        self._fh = fh
        self.sha256 = hashlib.sha256()
        self.bytes = 0

    def write(self, data: bytes) -> int:
        written = self._fh.write(data)
        view = memoryview(data)[: written if written is not None else len(data)]
        self.sha256.update(view)
        self.bytes += len(view)
        return len(view)

    def flush(self) -> None:
        self._fh.flush()


def fsync_dir(directory: str | Path) -> None:
    """Make a rename in ``directory`` durable (no-op where folders cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder; the rename is still atomic
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | Path, write: Callable[[BinaryIO], Any]) -> tuple[int, str]:
    """Write ``path`` through ``write(fh)`` so readers see the old file or the whole new one.

    Temporary file in the same folder, flush, fsync, rename, fsync of the folder.
    On any error the temporary file is removed and the error re-raised; ``path``
    is untouched.

    Returns:
        (size in bytes, SHA-256 hex digest) of what was written.
    """
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        out = _HashingWriter(fh)
        write(out)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(path.parent)
    return out.bytes, out.sha256.hexdigest()


def sha256_file(path: str | Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file, read in 1 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


