"""Writing files so that readers never see half of one (both sides of the launch).

Standard library only. Two kinds of output:

* whole files (summaries, CSVs, plots, images, reports, checkpoints) go through
  :func:`atomic_path`: a temporary file in a private folder made beside the target
  (no name another user can guess or plant a link at), renamed over it once
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
import stat
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from multigpu.errors import OutputError

__all__ = ["PRIVATE_UMASK", "JsonlLog", "Temporary", "append_line", "atomic_path", "cannot_write", "create_exclusive",
           "describe_os_error", "os_error_in",
           "private_files", "read_jsonl", "replace_files", "set_user_umask", "user_made", "user_umask", "write_failure", "write_json_atomic",
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
        _chmod_no_follow(item, umask)
    return path


def _chmod_no_follow(item: Path, umask: int) -> None:
    """Give ``item`` the mode a plain create under ``umask`` makes, through a descriptor opened without following a
    link (a link put in its place meanwhile, in a folder another user owns, is left alone, as is its target)."""
    try:
        fd = os.open(item, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:  # a link (ELOOP), or gone
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
            os.fchmod(fd, (0o777 if stat.S_ISDIR(st.st_mode) else 0o666) & ~umask)
    finally:
        os.close(fd)


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
    """Yield a temporary path to write ``path``'s content to; on success it is renamed over ``path``, on error removed.

    The temporary lies in a folder of this process's own, made beside ``path`` with a name no one can guess
    (``.<name>.<random>.tmp/``, mode 0700, ``mkdir`` that never follows a link), and is named ``path``'s own name in
    it, so a writer that picks the format from the name (``savefig``, image libraries, ``.nii.gz``) sees the suffix.
    On Linux the yielded path reaches that folder through this process's descriptor of it
    (``/proc/self/fd/<n>/<name>``): whoever owns ``path``'s folder can rename or replace any entry in it (a link
    planted at the temporary's name, a folder of links put where ours was), and the write still goes to the file
    this process made, never through a link. The rename that ends the write replaces whatever ``path`` is (a link
    planted there included) without following it.

    Args:
        path: The file to write (its folder is created).
        keep_suffix: Kept for callers; the temporary always ends with ``path``'s own name.

    Raises:
        OutputError: the folder or the file could not be written (an ``OSError``: disk full,
            read-only, no permission), naming ``path``; the original error is its ``__cause__``.
    """
    del keep_suffix
    path = Path(path)
    temporary = None
    try:
        temporary = Temporary(path)
        yield temporary.path
        temporary.commit()
    except OSError as exc:
        raise cannot_write(path, exc) from exc
    finally:
        if temporary is not None:
            temporary.discard()


_PROC_FD = os.path.isdir("/proc/self/fd") and sys.platform.startswith("linux")
"""A folder's descriptor reaches it by path (``/proc/self/fd/<n>/...``) whatever its name becomes (Linux)."""


class Temporary:
    """The temporary of one whole-file write of ``target`` (see :func:`atomic_path`, which is this as a ``with``):
    :attr:`path` to write to, then :meth:`commit` puts it in place, and :meth:`discard` (always) removes what is
    left. For a write that spans calls (a table written a part at a time).

    Raises:
        OSError: from the constructor and :meth:`commit`, as the file system gives it.
    """

    def __init__(self, target: str | Path):
        self.target = Path(target)
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self._folder_fd = os.open(self.target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._own, self._own_fd = _own_folder(self.target.parent, self._folder_fd, self.target.name)
        except BaseException:
            os.close(self._folder_fd)
            raise
        name = self.target.name
        self.path = Path(f"/proc/self/fd/{self._own_fd}", name) if _PROC_FD else self.target.parent / self._own / name
        """Where to write: ``target``'s own name, in this write's own folder."""

    def commit(self, *, exclusive: bool = False) -> bool:
        """Put the written file at ``target``: renamed over whatever is there (a link is replaced, not followed), or,
        ``exclusive``, hard-linked there only if nothing is (returns False when something is). The temporary must be
        a regular file (not a link put in its place)."""
        name = self.target.name
        st = os.stat(name, dir_fd=self._own_fd, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"the temporary of {self.target} is not a regular file")
        if not exclusive:
            os.replace(name, name, src_dir_fd=self._own_fd, dst_dir_fd=self._folder_fd)
            return True
        try:
            os.link(name, name, src_dir_fd=self._own_fd, dst_dir_fd=self._folder_fd, follow_symlinks=False)
        except FileExistsError:
            return False
        return True

    def discard(self) -> None:
        """Remove the temporary (if still there) and this write's folder (if still where it was made: one put in its
        place is left alone); idempotent."""
        if self._own_fd < 0:
            return
        with contextlib.suppress(OSError):
            os.unlink(self.target.name, dir_fd=self._own_fd)
        with contextlib.suppress(OSError):
            if os.fstat(self._own_fd)[:2] == os.stat(self._own, dir_fd=self._folder_fd, follow_symlinks=False)[:2]:
                os.rmdir(self._own, dir_fd=self._folder_fd)
        os.close(self._own_fd)
        os.close(self._folder_fd)
        self._own_fd = self._folder_fd = -1


def _own_folder(parent: Path, folder_fd: int, name: str) -> tuple[str, int]:
    """Make a folder of this process's own in ``parent`` (open as ``folder_fd``), named ``.<name>.<random>.tmp``
    (``mkdir`` refuses a name that exists, a link included: another name is drawn); its name and a descriptor of it,
    checked to be the folder made (this user's, no one else's to enter), not one put in its place between the two."""
    import secrets

    for _ in range(100):
        own = f".{name[:200]}.{secrets.token_hex(6)}.tmp"
        try:
            os.mkdir(own, 0o700, dir_fd=folder_fd)
        except FileExistsError:
            continue
        fd = os.open(own, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder_fd)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            os.close(fd)
            raise OSError(errno.EEXIST, f"a folder of another user's took the place of this write's temporary in "
                                        f"{parent}")
        return own, fd
    raise OSError(errno.EEXIST, f"no free temporary name in {parent}")


def replace_files(source: str | Path, names: Iterable[str], folder: str | Path) -> None:
    """Move the finished files ``names`` of ``source`` (a folder of this process's own) into ``folder`` (made if
    missing), each by one rename over whatever holds its name there: a reader of ``folder`` finds each file whole,
    the old one or the new one, and a second writer doing the same meanwhile never leaves it without them (a link
    at ``folder`` itself is refused, a link at a file's name is replaced, neither followed).

    Raises:
        OSError: as the file system gives it (``folder`` a link: ELOOP).
    """
    folder = Path(folder)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(parents=True)
    src_fd = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        dst_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for name in names:
                os.replace(name, name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        finally:
            os.close(dst_fd)
    finally:
        os.close(src_fd)


def create_exclusive(path: str | Path, data: bytes) -> bool:
    """Create ``path`` holding ``data``, whole, only if nothing is there (a link included): False if something is.
    Written in a write's own folder (:class:`Temporary`), then hard-linked into place: a reader sees all of it or
    nothing, and no link planted beside it is followed.

    Raises:
        OSError: as the file system gives it.
    """
    temporary = Temporary(path)
    try:
        fd = os.open(temporary.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as fh:
            fh.write(data)
        return temporary.commit(exclusive=True)
    finally:
        temporary.discard()


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
