"""Atomic, checksummed checkpoint files in one folder (standard library only; no communication).

Used by training (:mod:`multigpu.train.checkpoint`) and meant for any workload
that saves its state every so often (the simulation, later). It runs wherever
it is called; in a job that is rank 0, which owns the output.

A checkpoint folder::

    ckpt_00000040.pt     one file per checkpoint, named by step
    ckpt_00000050.pt
    manifest.json        {"format": 1, "checkpoints": [{"file", "step", "bytes", "sha256", "time"}, ...]}

Saving (:meth:`CheckpointFolder.save`):

1. ``write(fh)`` streams the state into ``.ckpt_<step>.pt.tmp<pid>`` in the same
   folder, while SHA-256 and the size are computed over the bytes written;
2. flush, fsync, rename into place, fsync the folder;
3. the manifest gets the new entry the same way (temporary file, fsync, rename,
   fsync the folder);
4. checkpoints beyond ``keep_last`` leave the manifest, then the disk.

A failure at any point (a full disk: ``ENOSPC`` from a write, the fsync or the
close) removes the temporary file and raises :class:`CheckpointWriteError`; the
previous checkpoints and the manifest are untouched. A process killed mid-write
leaves only a ``.tmp`` file, which no reader looks at and the next save deletes.

Loading (:meth:`CheckpointFolder.verify`, :meth:`CheckpointFolder.latest_valid`):
a listed checkpoint must have the recorded size (else "truncated") and SHA-256
(else "checksum mismatch"); :class:`CorruptCheckpointError` names the file and
what is wrong, and ``latest_valid`` falls back to the previous checkpoint,
warning about each one it skips. A checkpoint file the manifest does not list
(the writer was killed between the rename and the manifest update, or someone
put it there) has no checksum to compare: it is never loaded, only named in a
warning. Nothing here unpickles a file: checking a checkpoint is reading its
bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from multigpu.errors import MultigpuError
from multigpu.files import atomic_path, describe_os_error

__all__ = [
    "CheckpointError",
    "CheckpointFolder",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "atomic_write",
    "fsync_dir",
    "restart_count",
    "sha256_file",
]

MANIFEST = "manifest.json"
_FORMAT = 1
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


def restart_count() -> int:
    """How many times torchrun's agent has restarted this worker group (``--max-restarts``); 0 on the first attempt.

    Read from ``TORCHELASTIC_RESTART_COUNT``, which the agent sets in every worker.
    A workload resumes from its newest valid checkpoint when this is above 0.
    """
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def _stderr_warning(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``, if any: torch.save re-raises a full disk as a RuntimeError
    ("unexpected pos ...") from its zip writer's cleanup, with the OSError as its context."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class CheckpointFolder:
    """Checkpoints named ``<prefix><step:08d><suffix>`` in ``directory``, listed in ``manifest.json``.

    Args:
        directory: The folder (created on the first save).
        keep_last: Checkpoints kept; older ones are deleted after each save.
        prefix, suffix: The file name around the step number.
        warn: Called with a one-line message for each checkpoint skipped while
            looking for the newest valid one (default: print to stderr).
    """

    def __init__(
        self,
        directory: str | Path,
        keep_last: int = 3,
        *,
        prefix: str = "ckpt_",
        suffix: str = ".pt",
        warn: Callable[[str], None] = _stderr_warning,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.prefix, self.suffix = prefix, suffix
        self.warn = warn
        self._name = re.compile(rf"^{re.escape(prefix)}(\d{{8,}}){re.escape(suffix)}$")

    # ------------------------------------------------------------------ names
    def path_for(self, step: int) -> Path:
        return self.directory / f"{self.prefix}{step:08d}{self.suffix}"

    def files(self) -> list[Path]:
        """Checkpoint files present in the folder, oldest step first (listed or not)."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if self._name.match(p.name)]
        return sorted(found, key=lambda p: int(self._name.match(p.name)[1]))

    # ------------------------------------------------------------------ manifest
    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST

    def manifest(self) -> dict[str, dict[str, Any]]:
        """The manifest's entries by file name ({} when there is none, or it cannot be read: warned)."""
        try:
            data = json.loads(self.manifest_path.read_text())
            return {e["file"]: e for e in data["checkpoints"]}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.warn(f"{self.manifest_path} cannot be read ({type(exc).__name__}: {exc}); "
                      "no checkpoint in this folder can be verified by checksum")
            return {}

    def _write_manifest(self, entries: list[dict[str, Any]]) -> None:
        text = json.dumps({"format": _FORMAT, "checkpoints": entries}, indent=2).encode()
        atomic_write(self.manifest_path, lambda fh: fh.write(text))

    # ------------------------------------------------------------------ saving
    def save(self, step: int, write: Callable[[BinaryIO], Any], *, meta: dict[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` through ``write(fh)``, record it, prune old ones; see the module docstring.

        ``meta``: plain JSON values recorded in its manifest entry (read without opening the checkpoint:
        training records its parameters' shapes, so the launcher can check a resume without unpickling).

        Raises:
            CheckpointWriteError: the file or the manifest could not be written (disk full,
                permission, I/O error); the message names the file, the reason and the
                newest checkpoint left intact.
        """
        path = self.path_for(step)
        entries = self.manifest()
        replaced = path.name in entries
        written = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_stale_temporaries()
            size, digest = atomic_write(path, write)
            written = True
            entries[path.name] = {"file": path.name, "step": step, "bytes": size, "sha256": digest,
                                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(meta or {})}
            kept = sorted(entries.values(), key=lambda e: e["step"])[-self.keep_last:]
            self._write_manifest(kept)
        except Exception as exc:
            cause = _os_error_in(exc)
            if cause is None:  # not the disk: e.g. a state that does not pickle; the folder is unchanged anyway
                raise
            if written and not replaced:  # the manifest could not record it: leave the folder as it was
                path.unlink(missing_ok=True)
            previous = [e["file"] for e in sorted(entries.values(), key=lambda e: e["step"]) if e["file"] != path.name]
            intact = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
            raise CheckpointWriteError(
                f"could not write checkpoint {path}: {describe_os_error(cause)}; {intact}"
            ) from exc
        self._prune({e["file"] for e in kept})
        return path

    def _remove_stale_temporaries(self) -> None:
        for p in self.directory.glob(".*.tmp*"):
            p.unlink(missing_ok=True)

    def _prune(self, keep: set[str]) -> None:
        """Delete checkpoint files the manifest no longer lists, keeping the newest ``keep_last`` overall."""
        files = self.files()
        for old in files[: max(len(files) - self.keep_last, 0)]:
            if old.name not in keep:
                old.unlink(missing_ok=True)

    # ------------------------------------------------------------------ reading
    def verify(self, path: str | Path, entry: dict[str, Any] | None = None) -> None:
        """Check ``path`` against its manifest entry: present, full size, same SHA-256.

        Raises:
            CorruptCheckpointError: naming the file and what is wrong.
        """
        path = Path(path)
        if entry is None:
            entry = self.manifest().get(path.name) if path.parent.resolve() == self.directory.resolve() else None
        if not path.is_file():
            raise CorruptCheckpointError(path, "the file does not exist")
        if entry is None:
            raise CorruptCheckpointError(path, f"it is not listed in {self.manifest_path}, so it has no checksum "
                                                "to verify it by and is not loaded")
        size, digest = sha256_file(path)
        if size != entry["bytes"]:
            what = "truncated" if size < entry["bytes"] else "longer than written"
            raise CorruptCheckpointError(path, f"{what}: {size:,} bytes on disk, {entry['bytes']:,} written")
        if digest != entry["sha256"]:
            raise CorruptCheckpointError(
                path, f"checksum mismatch: SHA-256 {digest[:16]}… on disk, {entry['sha256'][:16]}… written "
                "(the file was altered or damaged after it was saved)")

    def latest_valid(self, check: Callable[[Path], Any] | None = None) -> Path | None:
        """The newest checkpoint that verifies (and passes ``check(path)``, if given), else None.

        Each checkpoint skipped on the way is reported through ``warn`` with its reason.
        A file the manifest does not list is skipped (warned) before ``check`` sees it:
        without a recorded checksum it is never loaded.
        """
        entries = self.manifest()
        for path in reversed(self.files()):
            entry = entries.get(path.name)
            try:
                if entry is None:
                    raise CorruptCheckpointError(
                        path, f"it is not listed in {self.manifest_path} (a writer stopped before recording it, "
                        "or the file was put there), so it has no checksum and is not loaded")
                self.verify(path, entry)
                if check is not None:
                    check(path)
                return path
            except CorruptCheckpointError as exc:
                self.warn(f"skipping {exc}")
            except Exception as exc:  # noqa: BLE001 - what ``check`` raised: the file does not load
                self.warn(f"skipping checkpoint {path}: it does not load ({type(exc).__name__}: {exc})")
        return None
