"""Run and log folders that multigpu creates are its user's only.

A log folder's entries name the run id (``<run_id>_<random>/``), and worker output, configs and checkpoints are
nobody else's to read: each folder the launcher makes is 0700. A folder that already exists keeps the mode its
owner gave it.
"""

from __future__ import annotations

from multigpu.jobs.command import create_run_dir
from multigpu.launch import agent, rundir


def _mode(path) -> int:
    return path.stat().st_mode & 0o777


def test_new_run_and_log_folders_are_private_and_existing_ones_keep_their_mode(tmp_path):
    fresh = create_run_dir(tmp_path / "runs" / "train" / "20260101-000000", fresh=True)
    again = create_run_dir(tmp_path / "runs" / "train" / "20260101-000000", fresh=True)  # same second: -2
    given = tmp_path / "mine" / "run"
    create_run_dir(given, fresh=False)
    assert again.name.endswith("-2") and _mode(fresh) == _mode(again) == _mode(given) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    rundir.create(shared)
    assert _mode(shared) == 0o755
    logs = tmp_path / "project" / "logs"
    agent._private_folder(str(logs))
    assert _mode(logs) == 0o700
    agent._private_folder(str(shared))
    assert _mode(shared) == 0o755
