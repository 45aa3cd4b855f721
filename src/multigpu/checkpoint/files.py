"""The file primitives under every checkpoint: atomic, checksummed writes (standard library only).

:class:`multigpu.checkpoint.CheckpointStore` (the one store of every workload) writes through
:func:`atomic_write`: a temporary file in the same folder, its bytes read back and hashed (SHA-256, size)
while they are fsynced, renamed into place, the folder fsynced. A failure at any
point (a full disk: ``ENOSPC`` from a write, the fsync or the close) removes the temporary file;
the target is untouched. The errors every checkpoint reader and writer raises are in :mod:`multigpu.errors`.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from multigpu.files import atomic_path

__all__ = [
    "atomic_write",
    "fsync_dir",
    "sha256_file",
    "synced_digest",
]

_CHUNK = 1 << 20


class _CountingWriter:
    """A write-only file object that counts what passes through it."""

    def __init__(self, fh: BinaryIO):
        self._fh = fh
        self.bytes = 0

    def write(self, data: bytes) -> int:
        written = self._fh.write(data)
        n = written if written is not None else len(memoryview(data))
        self.bytes += n
        return n

    def flush(self) -> None:
        self._fh.flush()


def synced_digest(path: str | Path, fd: int | None = None) -> tuple[int, str]:
    """fsync the file at ``path`` (through ``fd`` when given) and return (size, SHA-256) of its bytes, read back
    while the fsync runs: both wait without holding the GIL, so hashing takes none of the time the disk needs
    to take the bytes, and the digest is that of what was written (not of what was meant to be)."""
    failed: list[OSError] = []
    own = fd is None
    if own:
        fd = os.open(path, os.O_RDONLY)

    def sync() -> None:
        try:
            os.fsync(fd)
        except OSError as exc:  # a full disk often shows here: raised on the calling thread below
            failed.append(exc)

    syncer = threading.Thread(target=sync, name="multigpu-fsync", daemon=True)
    syncer.start()
    try:
        return sha256_file(path)
    finally:
        syncer.join()
        if own:
            os.close(fd)
        if failed:
            raise failed[0]


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

    Temporary file in the same folder, flush, fsync (the bytes read back and hashed meanwhile:
    :func:`synced_digest`), rename, fsync of the folder. On any error the temporary file is removed
    and the error re-raised; ``path`` is untouched.

    Returns:
        (size in bytes, SHA-256 hex digest) of what was written.
    """
    path = Path(path)
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        write(_CountingWriter(fh))
        fh.flush()
        size, digest = synced_digest(tmp, fh.fileno())
    fsync_dir(path.parent)
    return size, digest


def sha256_file(path: str | Path) -> tuple[int, str]:
    """(size in bytes, SHA-256 hex digest) of a file, read in 1 MiB chunks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


