"""Writing files so that readers never see half of one (both sides of the launch).

Standard library only. Two kinds of output:

* whole files (summaries, CSVs, plots, images, reports, checkpoints) go through
  :func:`atomic_path`: a temporary file beside the target, renamed over it once
  complete, removed if writing fails;
* line logs (``metrics.jsonl``, ``samples_node<k>.jsonl``) go through
  :func:`append_line` / :class:`JsonlLog`: a line is appended whole or not at
  all (a write that fails half-way is cut back off), so a reader sees only whole
  lines, except after a process was killed mid-write, which readers skip as a
  torn last line.

A write that fails for a reason of the disk (full, read-only, no permission)
raises :class:`~multigpu.errors.OutputError`, one line naming the file and the
cause: ``could not write runs/x/summary.json: No space left on device (ENOSPC)``.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from multigpu.errors import OutputError

__all__ = ["PRIVATE_UMASK", "JsonlLog", "append_line", "atomic_path", "cannot_write", "describe_os_error", "os_error_in",
           "private_files", "read_jsonl", "set_user_umask", "user_made", "user_umask", "write_failure", "write_json_atomic",
           "write_text_atomic"]

PRIVATE_UMASK = 0o077
"""The umask every ``multigpu`` command runs under: what it writes is its user's only (folders 0700, files 0600),
in a folder it made and in one that existed with wider permissions (a ``--run-dir`` or ``--log-dir`` of 0755)
alike. A user's script launched by ``multigpu launch`` gets the user's own umask back (:func:`user_umask`)."""

_USER_UMASK: list[int] = []
_RANK_USER_UMASK: list[int] = []
"""In a rank: the user's umask as the launcher read it (``run.json``), set by :func:`set_user_umask`."""


@contextlib.contextmanager
def private_files() -> Iterator[None]:
    """Run the block under :data:`PRIVATE_UMASK` (processes started in it inherit it), then put the umask back."""
    previous = os.umask(PRIVATE_UMASK)
    _USER_UMASK.append(previous)
    try:
        yield
    finally:
        _USER_UMASK.pop()
        os.umask(previous)


def set_user_umask(mask: int | None) -> None:
    """In a rank of a built-in workload (which runs under the launcher's 0077): the user's own umask, from run.json."""
    _RANK_USER_UMASK[:] = [] if mask is None else [int(mask)]


def user_umask() -> int:
    """The umask the user's shell gave this process (read without changing it, also inside :func:`private_files`
    and in the ranks of a built-in workload)."""
    if _USER_UMASK:
        return _USER_UMASK[0]
    if _RANK_USER_UMASK:
        return _RANK_USER_UMASK[0]
    current = os.umask(PRIVATE_UMASK)
    os.umask(current)
    return current


def user_made(path: str | Path) -> Path:
    """Give an output the user named (``infer --output``, ``--save-agents``, ``report -o``) the modes a plain
    ``open``/``mkdir`` under the user's own umask makes, with what a folder holds: the command itself runs under
    :data:`PRIVATE_UMASK`, which is meant for the run and log folders, not for files the user asked for by name."""
    path = Path(path)
    umask = user_umask()
    for item in [path, *(path.rglob("*") if path.is_dir() and not path.is_symlink() else ())]:
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~umask)
    return path


def describe_os_error(exc: OSError) -> str:
    """``No space left on device (ENOSPC)``: the system's text and the errno's name."""
    name = errno.errorcode.get(exc.errno, "") if exc.errno else ""
    text = exc.strerror or str(exc)
    return f"{text} ({name})" if name else text


def cannot_write(path: str | Path, exc: OSError) -> OutputError:
    """The one-line error for a file that could not be written (with the cause's errno and strerror)."""
    if isinstance(exc, OutputError):
        return exc
    error = OutputError(f"could not write {path}: {describe_os_error(exc)}")
    error.errno, error.strerror, error.filename = exc.errno, exc.strerror, str(path)
    return error


def os_error_in(exc: BaseException | None) -> OSError | None:
    """The OSError behind ``exc``, if any: through ``__cause__``/``__context__`` (torch.save re-raises a full
    disk as ``RuntimeError: unexpected pos ...`` with the OSError as its context) and into the per-rank
    failures of DCP's ``CheckpointException``."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        exc = todo.pop(0)
        if not isinstance(exc, BaseException) or id(exc) in seen:
            continue
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        todo += [exc.__cause__ or exc.__context__]
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: {rank: (exception, stack)}
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()]
    return None


def write_failure(path: str | Path, exc: BaseException) -> str | None:
    """``could not write PATH: No space left on device (ENOSPC)`` when ``exc`` is a write failure (an
    OSError behind it, or no space left where ``path`` lies), else None (a bug: let it be seen)."""
    cause = os_error_in(exc)
    if cause is not None:
        return f"could not write {path}: {describe_os_error(cause)}"
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return None
    if free >= 1 << 20:
        return None
    full = describe_os_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return f"could not write {path}: {full} ({free} bytes free; the writer said: {str(exc).splitlines()[0][:200]})"


@contextlib.contextmanager
def atomic_path(path: str | Path, *, keep_suffix: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it over ``path``, on error remove it.

    Args:
        path: The file to write (its folder is created).
        keep_suffix: End the temporary name with ``path``'s suffix, for writers that pick the
            format from it (``savefig``, image libraries): ``.x.tmp<pid>.png`` instead of ``.x.png.tmp<pid>``.

    Raises:
        OutputError: the folder or the file could not be written (an ``OSError``: disk full,
            read-only, no permission), naming ``path``; the original error is its ``__cause__``.
    """
    path = Path(path)
    name = f".{path.stem}.tmp{os.getpid()}{path.suffix}" if keep_suffix else f".{path.name}.tmp{os.getpid()}"
    tmp = path.with_name(name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise cannot_write(path, exc) from exc
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (numbers torch or NumPy hand back become floats)."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=float))


def append_line(path: str | Path, line: str) -> None:
    """Append ``line`` and a newline to ``path``, whole or not at all.

    One ``O_APPEND`` descriptor; if a write fails part-way (the disk filled up), the file is cut
    back to its length before, so no torn line stays behind.

    Raises:
        OutputError: naming the file and the cause.
    """
    path = Path(path)
    data = memoryview((line.rstrip("\n") + "\n").encode())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise cannot_write(path, exc) from exc
    try:
        start = os.fstat(fd).st_size
        try:
            while data:
                data = data[os.write(fd, data):]
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)  # a half-written line would be a torn record for every reader
            raise cannot_write(path, exc) from exc
    finally:
        os.close(fd)


class JsonlLog:
    """A JSON-lines file that monitoring appends to, one whole record per line.

    Monitoring does not stop a run: a record that cannot be written is dropped and
    the first such failure is said once, on stderr, naming the file and the cause;
    later records are tried again (space may have been freed).

    Args:
        path: The ``.jsonl`` file.
        what: What the lines are, for the warning (``metrics records``).
    """

    def __init__(self, path: str | Path, what: str = "records"):
        self.path = Path(path)
        self.what = what
        self.failures = 0

    def append(self, record: dict[str, Any]) -> bool:
        """Write ``record`` as one line. Returns False (after warning, the first time) when it could not."""
        try:
            append_line(self.path, json.dumps(record, default=float))
        except OutputError as exc:
            if not self.failures:
                print(f"warning: {exc}; {self.what} are dropped until it can be written again (the run goes on)",
                      file=sys.stderr, flush=True)
            self.failures += 1
            return False
        return True


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a line that does not parse (a writer killed mid-line) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than json reads
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
