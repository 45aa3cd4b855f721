"""The launcher reads the job's cgroup memory limit (v2 memory.max, v1 memory.limit_in_bytes), tightest ancestor first.

Fake /proc and cgroup trees: the machine's own cgroups are not touched (the cgroup-capped
training run is tests/cli/test_fsdp_cgroup.py).
"""

from __future__ import annotations

from pathlib import Path

from multigpu.launch.memlimit import effective_memory_limit

V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_MOUNT = "31 25 0:27 / /sys/fs/cgroup/memory rw,nosuid - cgroup cgroup rw,memory\n"


def _tree(tmp: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    proc = tmp / "proc"
    proc.mkdir(parents=True)
    (proc / "cgroup").write_text(cgroup)
    (proc / "mountinfo").write_text(mountinfo)
    for name, text in files.items():
        path = tmp / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc


def test_v2_reads_the_tightest_limit_on_the_way_to_the_root(tmp_path):
    proc = _tree(tmp_path, "0::/jobs/train\n", V2_MOUNT, {
        "/sys/fs/cgroup/jobs/train/memory.max": "max\n",  # no limit of its own...
        "/sys/fs/cgroup/jobs/memory.max": "6442450944\n",  # ...but its parent has 6 GiB
        "/sys/fs/cgroup/jobs/memory.current": "1073741824\n",
    })
    got = effective_memory_limit(proc, tmp_path)
    assert got is not None and got.limit == 6 << 30 and got.available == 5 << 30
    assert got.path.endswith("jobs")


def test_v1_memory_controller_and_no_limit(tmp_path):
    proc = _tree(tmp_path, "4:memory:/capped\n0::/\n", V1_MOUNT, {
        "/sys/fs/cgroup/memory/capped/memory.limit_in_bytes": "3221225472\n",
        "/sys/fs/cgroup/memory/capped/memory.usage_in_bytes": "221225472\n",
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",  # v1's "unlimited"
    })
    got = effective_memory_limit(proc, tmp_path)
    assert got is not None and got.limit == 3 << 30 and got.available == (3 << 30) - 221225472
    free = _tree(tmp_path / "free", "4:memory:/\n", V1_MOUNT, {
        "/sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert effective_memory_limit(free, tmp_path / "free") is None
