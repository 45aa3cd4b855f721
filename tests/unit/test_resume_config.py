"""``--resume`` in the launcher: the run's own config is reused, a key the workload keeps may not
change (one line naming it), a workload that cannot resume refuses ``--resume`` before anything starts, and an
outside workload that does not say it resumes refuses it too. Nothing here spawns a rank."""

from __future__ import annotations

import json

import pytest

from multigpu.cli import main


@pytest.fixture
def launched(monkeypatch, fake_gpus):
    """torch's launcher replaced by a recorder: one entry per launch (the run's run.json is on disk)."""
    fake_gpus(0)
    seen: list[str] = []

    def record(config, entrypoint, args):
        seen.append(entrypoint)

    monkeypatch.setattr("multigpu.launch.agent._elastic_launch", record)
    return seen


def _sim_run(tmp_path):
    run = tmp_path / "run"
    assert main(["sim", "-f", "sir", "--run-dir", str(run), "--agents", "3000", "grid=[20,20]", "steps=4",
                 "params.beta=0.3", "plot=false"]) == 0
    return run


def test_resume_reuses_the_runs_config_and_applies_what_is_given_again(tmp_path, launched, capsys):
    run = _sim_run(tmp_path)
    first = json.loads((run / "run.json").read_text())["config"]
    assert main(["sim", "--run-dir", str(run), "--resume", "auto", "steps=8"]) == 0
    config = json.loads((run / "run.json").read_text())["config"]
    assert config == {**first, "steps": 8}  # not the preset's agents, grid or beta: the run's own
    assert config["agents"] == 3000 and config["grid"] == [20, 20] and config["params"]["beta"] == 0.3


def test_a_kept_key_given_again_with_another_value_is_one_line_exit_2(tmp_path, launched, capsys):
    run = _sim_run(tmp_path)
    before = (run / "run.json").read_text()
    capsys.readouterr()
    assert main(["sim", "--run-dir", str(run), "--resume", "auto", "--agents", "5000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --resume: sim.agents is 5000 here but 3000 in the run "
                                              "being resumed, and a resumed sim run keeps model, seed, grid, "
                                              "agents, params"), err
    assert (run / "run.json").read_text() == before and len(launched) == 1  # nothing launched, nothing written
    assert main(["sim", "--run-dir", str(run), "--resume", "auto", "--agents", "3000"]) == 0  # the same value


@pytest.mark.parametrize("argv", [
    ["infer", "--resume", "auto"],
    ["run", "multigpu.envs.job:WORKLOAD", "--resume", "auto"],  # a workload that does not say it resumes
])
def test_a_workload_that_cannot_resume_refuses_resume_before_anything_starts(tmp_path, launched, capsys, argv):
    run = tmp_path / "run"
    assert main([*argv, "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "workload cannot resume (it writes no checkpoints); valid: run it again without " \
                              "--resume" in err, err
    assert not run.exists() and not launched


def test_resuming_a_run_of_another_workload_is_one_line(tmp_path, launched, capsys):
    run = _sim_run(tmp_path)
    capsys.readouterr()
    assert main(["rl", "--run-dir", str(run), "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: --resume: {run} is a sim run, not a rl run; valid: multigpu sim --resume ..., or another --run-dir"
