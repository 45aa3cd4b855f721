"""The memory this process's cgroup still allows (in the launcher): cgroup v2 ``memory.max`` or v1 ``memory.limit_in_bytes``.

A job under a scheduler (SLURM, Kubernetes, ``systemd-run -p MemoryMax=``) may use
far less than the machine's free memory: the kernel kills it at its cgroup's
limit. :func:`effective_memory_limit` reads the tightest limit on the way from
this process's cgroup to the root (v2, or v1's memory controller) and how much
of it is in use, so a plan can be checked against what the job may really fill.

    effective_memory_limit()   # -> CgroupMemory(limit=6442450944, usage=1073741824, path=...) or None
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["CgroupMemory", "effective_memory_limit"]

_NO_LIMIT = 1 << 60  # v1 writes "no limit" as a huge page-aligned number (9223372036854771712)


@dataclass(frozen=True)
class CgroupMemory:
    limit: int
    """Bytes the cgroup (or an ancestor) may hold."""
    usage: int
    """Bytes it holds now (page cache included, as the kernel counts it)."""
    path: str
    """The cgroup folder whose limit is the tightest."""

    @property
    def available(self) -> int:
        return max(self.limit - self.usage, 0)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= _NO_LIMIT else value


def _mounts(mountinfo: str) -> tuple[Path | None, Path | None]:
    """(cgroup v2 mount, v1 memory-controller mount) from /proc/self/mountinfo."""
    v2 = v1 = None
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, kind = left.split(), right.split()
        if len(fields) < 5 or not kind:
            continue
        if kind[0] == "cgroup2" and v2 is None:
            v2 = Path(fields[4])
        elif kind[0] == "cgroup" and "memory" in (kind[2] if len(kind) > 2 else "").split(",") and v1 is None:
            v1 = Path(fields[4])
    return v2, v1


def effective_memory_limit(proc: Path = Path("/proc/self"), root: Path = Path("/")) -> CgroupMemory | None:
    """The tightest memory limit of this process's cgroup and its ancestors, with that cgroup's usage; None when
    no cgroup limits memory (or cgroups cannot be read). ``proc``/``root`` are for tests."""
    try:
        groups = (proc / "cgroup").read_text().splitlines()
        v2, v1 = _mounts((proc / "mountinfo").read_text())
    except OSError:
        return None
    candidates = []
    for line in groups:
        _, controllers, path = line.split(":", 2)
        if controllers == "" and v2 is not None:
            candidates.append((v2, path, "memory.max", "memory.current"))
        elif "memory" in controllers.split(",") and v1 is not None:
            candidates.append((v1, path, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    best: CgroupMemory | None = None
    for mount, path, limit_file, usage_file in candidates:
        folder = root / mount.relative_to("/") / path.lstrip("/")
        for level in (folder, *folder.parents):
            limit = _read_int(level / limit_file)
            if limit is not None:
                found = CgroupMemory(limit, _read_int(level / usage_file) or 0, str(level))
                if best is None or found.available < best.available:
                    best = found
            if level == root / mount.relative_to("/"):
                break
    return best
