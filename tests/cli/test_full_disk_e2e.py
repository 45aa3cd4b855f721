"""On a real full disk, the first line of the launcher's error names the checkpoint and the cause.

Each test mounts a 40 MiB tmpfs (root only; skipped with the reason elsewhere) as the run directory's
file system, and a callback of the test's own (the fault hook pattern of multigpu.testing.faults) fills it
after step 3, so the checkpoint at the end (train) or at step 5 (sim) meets a full disk. Before: train said
``the launcher could not start the job: Expecting value: line 1 column 1 (char 0)`` (the rank's error file
was left empty), sim ``exited with code 1 without a Python exception``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

_FILL = '''
import os


class Fill:
    def on_step(self, owner):
        step = getattr(owner, "step_index", None)
        if (owner.step if step is None else step) != 3 or os.environ.get("RANK") != "0":
            return
        run_dir = os.path.dirname(os.environ["MULTIGPU_RUN_FILE"])
        with open(os.path.join(os.path.dirname(run_dir), "filler"), "ab") as fh:
            try:
                while True:
                    fh.write(bytes(1 << 16))
                    fh.flush()
            except OSError:
                pass


def hook():
    return Fill()
'''


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(disk)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    (tmp_path / "fill_here.py").write_text(_FILL)
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def _run(argv: list[str], hooks: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), hooks, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "multigpu", *argv, "callbacks=[fill_here:hook]", "--cpu",
                           "--nproc-per-node", "2"], capture_output=True, text=True, timeout=300, env=env)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    return next((line for line in proc.stderr.splitlines() if line.startswith("error: ")), proc.stderr[-2000:])


@pytest.mark.e2e
def test_train_on_a_full_disk_names_the_checkpoint_and_the_cause(small_disk):
    proc = _run(["train", "-f", "nano", "steps=4", "--run-dir", str(small_disk / "run")], str(small_disk.parent))
    line = _error_line(proc)
    assert proc.returncode == 1 and line.startswith("error: rank "), line
    assert (f"CheckpointWriteError: could not write checkpoint {small_disk}/run/checkpoints/step_00000004: No space "
            "left on device (ENOSPC)") in line


@pytest.mark.e2e
def test_sim_on_a_full_disk_names_the_checkpoint_and_the_cause(small_disk):
    proc = _run(["sim", "-f", "sir", "--agents", "200000", "--steps", "12", "--checkpoint-every", "5", "--run-dir",
                 str(small_disk / "run")], str(small_disk.parent))
    line = _error_line(proc)
    assert proc.returncode == 1 and line.startswith("error: rank "), line
    # DCP's shards: the failing rank is named before the cause
    assert f"CheckpointWriteError: could not write checkpoint {small_disk}/run/checkpoints/step_00000005: " in line
    assert "No space left on device (ENOSPC)" in line
