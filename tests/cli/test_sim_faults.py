"""Simulation fault injection: a rank SIGKILLed mid-run, restarted by the agent, ends bit-identical."""

from __future__ import annotations

import json

import pytest

from tests.conftest import fault_callback, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

SIR = "sir"


def _run(run_dir, *extra, env=None):
    proc = run_cli("sim", "-f", SIR, "--agents", "20000", "--steps", "12", "--nproc-per-node", "2",
                   "--strategy", "spatial", "--checkpoint-every", "3", "--run-dir", str(run_dir),
                   "grid=[40,50]", "plot=false", *extra, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "summary.json").read_text()), (run_dir / "series.csv").read_text()


def test_a_killed_rank_is_restarted_and_the_simulation_ends_bit_identical(tmp_path, fault_rng):
    clean, clean_csv = _run(tmp_path / "clean")
    step = fault_rng.randint(4, 11)  # any step after the first checkpoint
    fault, env = fault_callback(tmp_path, rank=1, step=step)
    faulty, faulty_csv = _run(tmp_path / "faulty", "--max-restarts", "1", fault, env=env)
    assert faulty["resumed_from"] is not None, f"killed at step {step} but the run did not resume"
    assert faulty["state_digest"] == clean["state_digest"], f"final agents differ after a kill at step {step}"
    assert faulty_csv == clean_csv  # the whole aggregate time series, to the last digit
