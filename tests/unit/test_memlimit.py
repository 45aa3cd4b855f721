"""Memory checks see the cgroup's limit, and a SIGKILLed rank is named as the OOM killer's.

The readers run over a folder of faked ``/proc`` and ``/sys/fs/cgroup`` files (v2, v1, a container's
view, nesting, "no limit" spellings); the launcher's checks are run through the real ``HostFacts.probe``
with the reader pointed at such a folder; one test puts a real process in a real cgroup where this
machine lets it (skipped with the reason where not).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from multigpu.launch.memlimit import MemoryWatch, cgroup_memory

GIB, MIB = 1 << 30, 1 << 20
V1_NONE = "9223372036854771712"  # what cgroup v1 writes for "no limit"


def _files(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def v2_tree(root: Path, job_max: str = str(6 * GIB), **extra: str) -> Path:
    """A cgroup v2 system, this process in /job/step; /job is capped at ``job_max``."""
    return _files(root, {
        "proc/self/cgroup": "0::/job/step\n",
        "proc/self/mountinfo": "30 24 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        "proc/vmstat": "pgfault 12\noom_kill 3\n",
        "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids\n",
        "sys/fs/cgroup/job/memory.max": f"{job_max}\n",
        "sys/fs/cgroup/job/memory.high": "max\n",
        "sys/fs/cgroup/job/memory.current": f"{2 * GIB}\n",
        "sys/fs/cgroup/job/memory.stat": f"anon {GIB}\nfile {GIB}\ninactive_file {GIB}\n",
        "sys/fs/cgroup/job/memory.events": "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n",
        "sys/fs/cgroup/job/step/memory.max": "max\n",
        "sys/fs/cgroup/job/step/memory.high": f"{8 * GIB}\n",
        "sys/fs/cgroup/job/step/memory.current": f"{GIB}\n",
        **extra,
    })


def v1_container(root: Path, limit: str = str(2 * GIB)) -> Path:
    """A cgroup v1 container: its mount's root is its own cgroup, /proc/self/cgroup shows the host's path."""
    return _files(root, {
        "proc/self/cgroup": "12:pids:/docker/abc\n4:memory:/docker/abc\n0::/\n",
        "proc/self/mountinfo": ("40 30 0:40 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                                "41 30 0:41 /docker/abc /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"),
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{limit}\n",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{512 * MIB}\n",
        "sys/fs/cgroup/memory/memory.stat": f"cache 1\ntotal_inactive_file {256 * MIB}\n",
        "sys/fs/cgroup/memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
        "sys/fs/cgroup/memory/memory.max_usage_in_bytes": f"{600 * MIB}\n",
    })


# ----------------------------------------------------------------------------- reading the limit
def test_cgroup_v2_the_tightest_level_wins_and_the_working_set_is_taken_off(tmp_path):
    limit = cgroup_memory(v2_tree(tmp_path))
    assert limit is not None and limit.limit_bytes == 6 * GIB
    assert limit.available_bytes == 6 * GIB - (2 * GIB - GIB)  # usage less inactive page cache
    assert limit.source == "cgroup v2 memory.max of /sys/fs/cgroup/job"
    # memory.high below memory.max at the inner level: that is the limit now
    _files(tmp_path, {"sys/fs/cgroup/job/step/memory.high": f"{3 * GIB}\n"})
    limit = cgroup_memory(tmp_path)
    assert (limit.limit_bytes, limit.source) == (3 * GIB, "cgroup v2 memory.high of /sys/fs/cgroup/job/step")


def test_cgroup_v1_in_a_container_reads_its_own_mount(tmp_path):
    limit = cgroup_memory(v1_container(tmp_path))
    assert limit is not None and limit.limit_bytes == 2 * GIB and limit.version == 1
    assert limit.available_bytes == 2 * GIB - (512 - 256) * MIB
    assert limit.source == "cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory"


@pytest.mark.parametrize("case", ["v1 no limit", "v2 max", "v2 without the memory controller", "no cgroup files"])
def test_no_limit_reads_as_none(tmp_path, case):
    if case == "v1 no limit":
        v1_container(tmp_path, V1_NONE)
    elif case == "v2 max":
        v2_tree(tmp_path, "max", **{"sys/fs/cgroup/job/step/memory.high": "max\n"})
    elif case == "v2 without the memory controller":
        v2_tree(tmp_path, **{"sys/fs/cgroup/cgroup.controllers": "cpu io pids\n"})
    assert cgroup_memory(tmp_path) is None


# ----------------------------------------------------------------------------- the launcher's checks (and tests/faults)
def test_rlimit_as_caps_each_rank(monkeypatch):
    from multigpu.launch.config import LaunchConfig
    from multigpu.launch.devices import HostFacts, plan_devices

    facts = HostFacts(gpu_count=0, cores=2, available_bytes=64 * GIB, address_space_bytes=2 * GIB)
    plan = plan_devices(LaunchConfig(nproc_per_node=2), facts, inherited={})
    assert plan.memory_per_rank("cpu") == 2 * GIB - 600 * MIB
    assert plan.memory_words("cpu") == "rank (its RLIMIT_AS, ulimit -v, of 2 GiB)"


# ----------------------------------------------------------------------------- naming the OOM killer
def _sigkilled():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    return ChildFailedError("x", {0: ProcessFailure(local_rank=0, pid=1, exitcode=-9, error_file="")})


def test_a_sigkill_while_the_oom_count_rose_is_named_as_the_oom_killer(tmp_path):
    from multigpu.launch.agent import summarize_failure

    root = v2_tree(tmp_path)
    watch = MemoryWatch(root)
    plain = str(summarize_failure(_sigkilled(), 2, str(tmp_path), memory=watch)).splitlines()[0]
    assert plain == "rank 0 of 2 failed first (exit code -9): killed by signal SIGKILL"  # nothing points to memory
    _files(root, {"sys/fs/cgroup/job/memory.events": "oom 2\noom_kill 2\n"})
    first = str(summarize_failure(_sigkilled(), 2, str(tmp_path), memory=watch)).splitlines()[0]
    assert first == ("rank 0 of 2 failed first (exit code -9): killed by signal SIGKILL: the kernel's OOM killer: out "
                     "of memory (1 OOM kill(s) during the job under the 6 GiB cgroup v2 memory.max of /sys/fs/cgroup/job)")


def test_a_sigkill_with_the_peak_at_the_limit_is_probably_the_oom_killer(tmp_path):
    root = v1_container(tmp_path)
    _files(root, {"sys/fs/cgroup/memory/memory.oom_control": "oom_kill_disable 0\n"})  # a kernel without the count
    watch = MemoryWatch(root)
    assert watch.explain_sigkill() is None
    _files(root, {"sys/fs/cgroup/memory/memory.max_usage_in_bytes": f"{2 * GIB - 4096}\n"})
    assert watch.explain_sigkill() == ("probably the kernel's OOM killer: the job's memory peaked at 2 GiB of the "
                                       "2 GiB limit (cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory)")
    _files(root, {"proc/vmstat": "oom_kill 0\n"})  # without a cgroup count, the machine's own
    watch = MemoryWatch(root)
    _files(root, {"proc/vmstat": "oom_kill 1\n"})
    assert watch.explain_sigkill() == ("the kernel's OOM killer: out of memory (1 OOM kill(s) on this machine during "
                                       "the job under the 2 GiB cgroup v1 memory.limit_in_bytes of /sys/fs/cgroup/memory)")




def test_an_address_space_limit_a_rank_cannot_start_in_is_refused_up_front(monkeypatch, capsys, tmp_path):
    """``ulimit -v`` was compared with the data only (less a fixed 600 MiB): a limit that leaves a rank no room for
    torch and its threads was accepted, and the rank died in the allocator. A rank maps what the launcher maps
    (torch imported) plus a malloc arena and a stack per further thread; below that, one line names the limit."""
    from multigpu.launch.config import LaunchConfig
    from multigpu.launch.devices import HostFacts, plan_devices
    from tests.conftest import SCRIPTS, assert_bad_input

    facts = HostFacts(gpu_count=0, cores=8, available_bytes=64 * GIB, address_space_bytes=GIB, mapped_bytes=700 * MIB)
    plan = plan_devices(LaunchConfig(nproc_per_node=8), facts, inherited={})  # one thread each: 700 MiB
    assert plan.rank_mapped_bytes == 700 * MIB and plan.memory_per_rank("cpu") == GIB - 700 * MIB
    monkeypatch.setattr(HostFacts, "probe", classmethod(lambda cls: facts))
    line = assert_bad_input(["launch", "--nproc-per-node", "1", str(SCRIPTS / "exit_early.py")],
                            "error: ulimit -v (RLIMIT_AS) is 1 GiB per process, but a rank maps about 1.18 GiB of "
                            "address space before it holds any data (torch as this launcher maps it, and 8 thread(s))",
                            capsys)
    assert "valid: ulimit -v unlimited" in line


def test_a_rank_that_dies_of_a_refused_allocation_under_rlimit_as_is_told_so(monkeypatch):
    from multigpu.launch import memlimit
    from multigpu.launch.memlimit import explain_address_space

    text = ("RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 393216 bytes. Error code 12 (Cannot allocate memory)")
    monkeypatch.setattr(memlimit, "address_space_limit", lambda: None)
    assert explain_address_space(text) is None  # no limit: nothing to name
    line = explain_address_space(text, limit=GIB, mapped=700 * MIB)
    assert line.startswith("the rank ran under ulimit -v (RLIMIT_AS) of 1 GiB, which counts address space, not "
                           "memory in use (a torch rank maps about 700 MiB before any data")
    assert explain_address_space("ValueError: simulated failure on rank 1", limit=GIB) is None
