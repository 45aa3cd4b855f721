"""Memory limits on a real cgroup: a capped sim is refused up front, and a rank the OOM killer ends is named so.

Each test makes a child of this process's own memory cgroup (v2 or v1), caps it at 1 GiB, and runs the
command line in it; where this machine does not let it (no controller, not root, read-only), it skips
with the reason.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from multigpu.launch import memlimit

GIB = 1 << 30



def _writable_child(version: int) -> Path | str:
    """A new child of this process's own memory cgroup, or why there is none."""
    limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
    for v, mount, mount_root in memlimit._mounts(Path("/")):
        if v != version:
            continue
        own = memlimit._own_paths(Path("/")).get(version)
        if own is None:
            return f"this process has no cgroup v{version} path"
        folder = memlimit._levels(mount, mount_root, own)[0]
        child = folder / f"multigpu_test_{uuid.uuid4().hex[:8]}"
        try:
            child.mkdir()
        except OSError as exc:
            return f"cannot create a cgroup under {folder}: {exc.strerror}"
        if not (child / limit_file).exists():
            child.rmdir()
            return f"no {limit_file} in a new cgroup v{version} (the memory controller is not enabled for children)"
        return child
    return f"no cgroup v{version} memory hierarchy is mounted"


def _in_cgroup(version: int, limit: int, argv: list[str]) -> tuple[subprocess.CompletedProcess, Path]:
    """Run ``multigpu ARGV`` in a new child cgroup capped at ``limit`` (skips the test where none can be made)."""
    child = _writable_child(version)
    if isinstance(child, str):
        pytest.skip(child)
    limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
    try:
        (child / limit_file).write_text(str(limit))
        procs = child / "cgroup.procs"
        proc = subprocess.run([sys.executable, "-m", "multigpu", *argv], capture_output=True, text=True, timeout=180,
                              preexec_fn=lambda: procs.write_text(str(os.getpid())),
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    finally:
        child.rmdir()
    return proc, child


@pytest.mark.e2e
@pytest.mark.parametrize("version", [2, 1])
def test_a_real_cgroup_limit_refuses_a_sim_up_front(version, tmp_path):
    proc, child = _in_cgroup(version, GIB, ["sim", "-f", "sir", "--cpu", "--agents", "100_000_000",
                                            "--nproc-per-node", "2", "--run-dir", str(tmp_path / "r")])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr  # before: SIGKILL, no word of memory
    limit_file = "memory.max" if version == 2 else "memory.limit_in_bytes"
    assert f"the memory left under the 1 GiB cgroup v{version} {limit_file} of {child}" in proc.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("version", [2, 1])
def test_a_rank_the_oom_killer_ends_is_named_so(version, tmp_path):
    script = tmp_path / "hog.py"
    script.write_text("import multigpu as mg\nmg.init()\nblob = b'x' * (3 << 30)\n")  # 3 GiB in a 1 GiB cgroup
    proc, child = _in_cgroup(version, GIB, ["launch", "--cpu", "--nproc-per-node", "1", "--log-dir",
                                            str(tmp_path / "logs"), str(script)])
    first = proc.stderr.splitlines()[0] if proc.stderr else ""
    assert proc.returncode == 1 and first.startswith("error: rank 0 of 1 failed first (exit code -9): killed by "
                                                     "signal SIGKILL: the kernel's OOM killer: out of memory ("), first
    assert f"under the 1 GiB cgroup v{version}" in first and str(child) in first


@pytest.mark.e2e
@pytest.mark.parametrize("limit_mib, sigint", [(300, signal.SIG_DFL), (450, signal.SIG_IGN), (390, signal.SIG_DFL),
                                              (488, signal.SIG_DFL)])
def test_an_rlimit_as_too_small_for_torch_is_one_line(tmp_path, limit_mib, sigint):
    """Under a ``ulimit -v`` too small to load torch the command itself died in a traceback through the imports
    ("failed to map segment from shared object", or a MemoryError, as the limit falls). Also with SIGINT ignored,
    as a command started in the background of a script (`nohup multigpu ... &`) has it: the line came only where
    Ctrl-C could be answered. Issue 48: at 390 MiB torch's import aborted in C++ (`std::bad_alloc`, exit 134) and at
    488 MiB OpenBLAS ended it ("Memory allocation still failed after 10 retries"), neither with a multigpu line:
    the limit is compared with what loading takes before anything is loaded."""
    import resource

    def limited():
        signal.signal(signal.SIGINT, sigint)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    limit = limit_mib << 20
    proc = subprocess.run([sys.executable, "-m", "multigpu", "train", "-f", "nano", "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120, preexec_fn=limited)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: multigpu cannot load torch under ulimit -v (RLIMIT_AS) of {limit_mib} MiB ")
    assert "valid: ulimit -v unlimited" in proc.stderr and not (tmp_path / "r").exists()


@pytest.mark.e2e
def test_a_rank_that_runs_out_of_its_rlimit_as_is_told_so(tmp_path):
    """``ulimit -v`` (RLIMIT_AS) that lets a rank start but not hold its data: the rank died in the allocator and
    the summary never named the limit. Set in the launcher's process (every rank inherits it), as a shell would."""
    import resource

    script = tmp_path / "hog.py"
    script.write_text("import torch\nimport multigpu as mg\nmg.init()\nblob = torch.empty(3 << 30, dtype=torch.uint8)\n")
    limit = int(2.5 * GIB)
    proc = subprocess.run([sys.executable, "-m", "multigpu", "launch", "--cpu", "--nproc-per-node", "1", str(script)],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit)))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 1 and lines[0].startswith("error: rank 0 of 1 failed first (exit code 1): RuntimeError: "
                                                        "[enforce fail"), proc.stderr
    assert any(line.startswith("  memory: the rank ran under ulimit -v (RLIMIT_AS) of 2.5 GiB, which counts address "
                               "space") for line in lines), proc.stderr
