"""A rank whose script has ended always exits: ``launch`` and ``bench`` never wait forever on one (tier 3)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import SCRIPTS, run_cli

pytestmark = pytest.mark.e2e


def test_bench_on_a_ddp_script_that_destroys_its_group_before_dropping_its_model_finishes(tmp_path):
    """The DDP tutorial's ending (``destroy_process_group()``, then ``main()`` returns and frees the model) hung
    ``multigpu bench`` one run in four: the reducer freed the group with the interpreter lock held while gloo's
    thread waited for that lock. ``ddp_exit_race.py`` makes that race certain; without the worker wrapper's
    reference to every group it hangs on every run (the timeout below ends this test then)."""
    proc = run_cli("bench", "--nproc", "2", "-o", str(tmp_path / "bench"), str(SCRIPTS / "ddp_exit_race.py"),
                   timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout
    assert (tmp_path / "bench" / "bench.json").is_file()


def test_a_rank_that_does_not_exit_after_its_script_ended_is_ended_with_one_line_naming_what_it_waited_for():
    """A thread the script left running (not a daemon) keeps Python's exit waiting forever; the wrapper gives a
    finished rank the stall timeout to leave, from a C thread that needs no interpreter lock."""
    start = time.monotonic()
    proc = run_cli("launch", "--nproc-per-node", "1", "--stall-timeout-s", "3", str(SCRIPTS / "thread_left_running.py"),
                   timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "script ended" in proc.stdout
    assert ("error: rank 0 of 1 failed first (exit code 1): rank 0: its script ended, but the process did not exit "
            "within 3 s (--stall-timeout-s, else --timeout-s)") in proc.stderr, proc.stderr
    assert time.monotonic() - start < 90
