"""The memory this process may really use: cgroup limits and ``RLIMIT_AS`` (runs in the launcher).

Containers, SLURM and Kubernetes cap a job with a cgroup far below the host's
memory; psutil reports the host. :func:`cgroup_memory` reads the effective limit
of the cgroup this process is in, v2 (``memory.max`` and ``memory.high``) or v1
(``memory.limit_in_bytes``), at its own level and every ancestor's (the
tightest wins), and what the cgroup already holds: its working set, usage less
inactive page cache (``memory.stat``), as kubelet counts it. ``RLIMIT_AS`` caps
each process on its own (:func:`address_space_limit`) and counts address space, not memory in use: a rank
maps what the launcher maps (:func:`mapped_bytes`, torch imported) plus a malloc arena and a stack per thread
before it holds any data, and a rank that dies of a refused allocation under it is told so
(:func:`explain_address_space`).

:func:`oom_kills` counts the kernel's OOM kills (the cgroup's ``memory.events``
or ``memory.oom_control``, and ``/proc/vmstat``), so the launcher can say that a
rank killed by SIGKILL was killed by the OOM killer: the count rose while the
job ran.

The readers are pure functions over a root folder (``root="/"`` is the real
system; tests pass a folder of faked files) and never raise: a file that is
missing or unreadable means "no limit known".
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

from multigpu.units import format_bytes

__all__ = ["RANK_MAPPED_BYTES", "MemoryLimit", "MemoryWatch", "address_space_limit", "cgroup_memory",
           "explain_address_space", "mapped_bytes", "oom_kills"]

RANK_MAPPED_BYTES = 600 << 20
"""Address space a rank maps before it holds any data (torch imported, a gloo group: VmSize 620 MiB measured
here), where the launcher cannot read its own (:attr:`HostFacts.mapped_bytes`); under ``RLIMIT_AS`` a rank's
data must fit in what is left of it."""


_UNLIMITED = 1 << 60
"""Limits at or above this are "no limit" (v1 writes 9223372036854771712 for none)."""


@dataclass(frozen=True)
class MemoryLimit:
    """The tightest cgroup memory limit over this process's cgroup and its ancestors."""

    limit_bytes: int
    available_bytes: int
    """The limit less the cgroup's working set now (at the level where that leaves the least)."""
    file: str
    """``memory.max``, ``memory.high`` or ``memory.limit_in_bytes``."""
    folder: str
    """The cgroup folder that sets the limit (where the kernel counts the OOM kills it causes)."""
    shown: str
    """That folder as the system names it (without the test's root)."""
    version: int

    @property
    def source(self) -> str:
        """For messages: ``cgroup v2 memory.max of /sys/fs/cgroup/job``."""
        return f"cgroup v{self.version} {self.file} of {self.shown}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _number(path: Path) -> int | None:
    text = _read(path)
    if text is None or text.strip() in ("", "max"):
        return None
    try:
        value = int(text.split()[0])
    except ValueError:
        return None
    return value if value < _UNLIMITED else None


def _keyed(path: Path, key: str) -> int | None:
    """``key N`` from a flat keyed file (memory.stat, memory.events, memory.oom_control, /proc/vmstat)."""
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return None


def _mounts(root: Path) -> list[tuple[int, Path, str]]:
    """(version, mount point under ``root``, the mount's own root in the hierarchy) of memory cgroup mounts."""
    found = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup2" or (fstype == "cgroup" and "memory" in options):
            found.append((2 if fstype == "cgroup2" else 1, root / fields[4].lstrip("/"), fields[3]))
    return found


def _own_paths(root: Path) -> dict[int, str]:
    """This process's cgroup path per version (``/proc/self/cgroup``)."""
    out = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            out.setdefault(2, parts[2])
        elif "memory" in parts[1].split(","):
            out[1] = parts[2]
    return out


def _levels(mount: Path, mount_root: str, own: str) -> list[Path]:
    """This process's cgroup folder and its ancestors up to the mount point, innermost first."""
    relative = own
    if mount_root not in ("/", "") and (own == mount_root or own.startswith(mount_root.rstrip("/") + "/")):
        relative = own[len(mount_root):]  # a container sees the hierarchy from its own cgroup down
    folder = mount / relative.strip("/")
    if not folder.is_dir():
        folder = mount  # a cgroup namespace that hides the path: the mount point is this process's cgroup
    levels = [folder]
    while levels[-1] != mount and mount in levels[-1].parents:
        levels.append(levels[-1].parent)
    return levels


def _level_limit(folder: Path, version: int) -> tuple[int, int, str] | None:
    """(limit, working set, file name) of one cgroup folder, or None without a limit."""
    if version == 2:
        candidates = [(v, n) for n in ("memory.max", "memory.high") if (v := _number(folder / n)) is not None]
        usage, inactive = _number(folder / "memory.current"), _keyed(folder / "memory.stat", "inactive_file")
    else:
        candidates = [(v, "memory.limit_in_bytes")] if (v := _number(folder / "memory.limit_in_bytes")) else []
        usage, inactive = (_number(folder / "memory.usage_in_bytes"),
                           _keyed(folder / "memory.stat", "total_inactive_file"))
    if not candidates:
        return None
    limit, name = min(candidates)
    working = max((usage or 0) - (inactive or 0), 0)
    return limit, working, name


def cgroup_memory(root: str | Path = "/") -> MemoryLimit | None:
    """The effective cgroup memory limit of this process, or None where no cgroup limits it."""
    root = Path(root)
    own = _own_paths(root)
    best: MemoryLimit | None = None
    for version, mount, mount_root in _mounts(root):
        if version not in own or (version == 2 and "memory" not in (_read(mount / "cgroup.controllers") or "").split()):
            continue
        levels = _levels(mount, mount_root, own[version])
        for folder in levels:
            found = _level_limit(folder, version)
            if found is None:
                continue
            limit, working, name = found
            available = max(limit - working, 0)
            if best is None or available < best.available_bytes:
                shown = "/" + str(folder.relative_to(root)) if folder.is_relative_to(root) else str(folder)
                best = MemoryLimit(limit, available, name, str(folder), shown, version)
    return best


def address_space_limit() -> int | None:
    """``RLIMIT_AS`` of this process (inherited by each rank; None: unlimited)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY or soft >= _UNLIMITED else soft


def mapped_bytes(root: str | Path = "/") -> int | None:
    """The address space this process maps now (``VmSize`` of ``/proc/self/status``; None where unknown). In the
    launcher, which has imported torch as every rank will, it is what a rank maps before its own threads and data:
    ``RLIMIT_AS`` counts this, not the memory in use, so it is what that limit must leave room for."""
    for line in (_read(Path(root) / "proc/self/status") or "").splitlines():
        name, _, value = line.partition(":")
        if name == "VmSize" and value.split() and value.split()[0].isdigit():
            return int(value.split()[0]) * 1024
    return None


_ALLOCATION_FAILED = ("can't allocate memory", "cannot allocate memory", "memoryerror", "std::bad_alloc",
                      "can't start new thread", "failed to map segment", "errno 12", "out of memory")
"""What a rank's error says when the allocator, mmap or a new thread was refused memory."""


def explain_address_space(text: str, limit: int | None = None, mapped: int | None = None) -> str | None:
    """A line naming ``RLIMIT_AS`` when a rank's error ``text`` is a refused allocation and the limit is set (the
    rank inherited it); None otherwise. ``limit``, ``mapped``: default this process's (:func:`address_space_limit`,
    :func:`mapped_bytes`: the launcher, torch imported, maps about what a rank maps before its data)."""
    limit = address_space_limit() if limit is None else limit
    if limit is None or not any(words in text.lower() for words in _ALLOCATION_FAILED):
        return None
    mapped = mapped or mapped_bytes() or RANK_MAPPED_BYTES
    return (f"the rank ran under ulimit -v (RLIMIT_AS) of {format_bytes(limit)}, which counts address space, not "
            f"memory in use (a torch rank maps about {format_bytes(mapped)} before any data, and each thread "
            "reserves more); valid: ulimit -v unlimited (a cgroup or the scheduler's --mem caps real memory), or a "
            "larger limit")


def oom_kills(root: str | Path = "/", cgroup: MemoryLimit | None = None) -> dict[str, int]:
    """OOM kills counted so far: the cgroup's (where the kernel counts them) and the whole machine's."""
    root = Path(root)
    counts = {}
    if cgroup is not None:
        folder = Path(cgroup.folder)
        events = folder / ("memory.events" if cgroup.version == 2 else "memory.oom_control")
        if (n := _keyed(events, "oom_kill")) is not None:
            counts[f"cgroup {cgroup.shown}"] = n
    if (n := _keyed(root / "proc/vmstat", "oom_kill")) is not None:
        counts["this machine"] = n
    return counts


def _peak(limit: MemoryLimit | None) -> int | None:
    if limit is None:
        return None
    folder = Path(limit.folder)
    return _number(folder / ("memory.peak" if limit.version == 2 else "memory.max_usage_in_bytes"))


class MemoryWatch:
    """Taken when the job starts; after a rank dies by SIGKILL, :meth:`explain_sigkill` says whether the
    kernel's OOM killer did it (an OOM kill counted while the job ran, or the cgroup's peak memory at its limit)."""

    NEAR = 0.9
    """A peak at this fraction of the limit or above is "at the limit"."""

    def __init__(self, root: str | Path = "/"):
        self.root = root
        self.limit = cgroup_memory(root)
        self.kills = oom_kills(root, self.limit)
        self.peak = _peak(self.limit)

    def explain_sigkill(self) -> str | None:
        """``the kernel's OOM killer: ...`` or None when nothing points to it."""
        now = oom_kills(self.root, self.limit)
        rose = [(where, now[where] - n) for where, n in self.kills.items() if now.get(where, n) > n]
        if rose:
            where, count = rose[0]
            ours = self.limit is not None and where == f"cgroup {self.limit.shown}"  # said once, below
            place = "" if ours else "on this machine " if where == "this machine" else f"in {where} "
            under = (f" under the {format_bytes(self.limit.limit_bytes)} {self.limit.source}"
                     if self.limit is not None else "")
            return f"the kernel's OOM killer: out of memory ({count} OOM kill(s) {place}during the job{under})"
        peak = _peak(self.limit)
        if (self.limit is not None and peak is not None and peak >= self.NEAR * self.limit.limit_bytes
                and (self.peak is None or self.peak < peak or self.peak < self.NEAR * self.limit.limit_bytes)):
            return (f"probably the kernel's OOM killer: the job's memory peaked at {format_bytes(peak)} of the "
                    f"{format_bytes(self.limit.limit_bytes)} limit ({self.limit.source})")
        return None
