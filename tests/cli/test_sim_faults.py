"""Simulation fault injection: a rank SIGKILLed mid-run, restarted by the agent, ends bit-identical."""

from __future__ import annotations

import json

import pytest

from tests.conftest import fault_callback, logged_steps, run_cli, stopped_by_signal

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

SIR = "sir"


def _run(run_dir, *extra, env=None):
    proc = run_cli("sim", "-f", SIR, "--agents", "20000", "--steps", "12", "--nproc-per-node", "2",
                   "--strategy", "spatial", "--checkpoint-every", "3", "--run-dir", str(run_dir),
                   "grid=[40,50]", "plot=false", "log_every=1", *extra, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text()), (run_dir / "series.csv").read_text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted run both tests compare with: the same command for both, launched once per pytest
    worker that runs them (summary, series.csv)."""
    return _run(tmp_path_factory.mktemp("sim_faults") / "clean")


def test_a_killed_rank_is_restarted_and_the_simulation_ends_bit_identical(tmp_path, fault_rng, uninterrupted):
    clean, clean_csv = uninterrupted
    step = fault_rng.randint(4, 11)  # any step after the first checkpoint
    fault, env = fault_callback(tmp_path, rank=1, step=step)
    faulty, faulty_csv = _run(tmp_path / "faulty", "--max-restarts", "1", fault, env=env)
    assert faulty["resumed_from"] is not None, f"killed at step {step} but the run did not resume"
    assert faulty["state_digest"] == clean["state_digest"], f"final agents differ after a kill at step {step}"
    assert faulty_csv == clean_csv  # the whole aggregate time series, to the last digit
    assert logged_steps(tmp_path / "faulty") == list(range(1, 13))  # each step once, as the run counts it


def test_sigterm_ends_the_simulation_after_its_step_with_a_checkpoint_that_resumes_bit_identical(tmp_path,
                                                                                                   uninterrupted):
    """A pre-emption's SIGTERM to the launcher while rank 0 is at step 5: before, `multigpu sim` had no
    --checkpoint-on-interrupt, its ranks died where they stood and a resume started from the last cadence
    checkpoint (none here). Now every rank finishes step 5, its checkpoint is written, the launcher exits 143, and
    --resume auto ends with the agents and series of an uninterrupted run."""
    base = ["sim", "-f", SIR, "--agents", "20000", "--steps", "12", "--nproc-per-node", "2", "--strategy", "spatial",
            "--run-dir", str(tmp_path / "stopped"), "grid=[40,50]", "plot=false", "log_every=1"]
    done, env = stopped_by_signal(tmp_path, [*base, "--checkpoint-on-interrupt"], step=5)
    assert done.returncode == 143, done.stderr[-3000:]
    checkpoint = tmp_path / "stopped" / "checkpoints" / "step_00000005"
    assert f"interrupted after step 5: checkpoint {checkpoint}" in done.stdout, done.stdout[-2000:]
    assert (checkpoint / "manifest.json").is_file()
    resumed = run_cli(*base, "--resume", "auto", env=env, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {checkpoint}" in resumed.stdout, resumed.stdout[-2000:]
    clean, clean_csv = uninterrupted
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert summary["state_digest"] == clean["state_digest"]
    assert (tmp_path / "stopped" / "series.csv").read_text() == clean_csv
    # before, the resumed run logged its steps from 1 again, after the first run's 1..5: each step once now
    assert logged_steps(tmp_path / "stopped") == list(range(1, 13))
