"""The run harness (``multigpu.run.Run``), in one process: the rules every workload now shares.

* resume is decided by one function for a job and for a plain script, once: a context the rank entry point
  decided is not decided again (nothing said twice), a plain script's is decided by the run, a restarted
  worker group resumes whatever ``resume`` said, and the launcher's look-ahead names the same folder;
* callbacks get one event (the step, the state without its wrappers, the run) after each step, before that
  step's checkpoint; ``pkg.module:factory`` names are made by the run;
* a checkpoint comes after every ``checkpoint_every``-th step, after the last, after a step that asked to
  stop, and after the step a signal arrived in (which ends the steps); the run starts where it resumed.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys

import pytest
import torch

from multigpu.checkpoint import PerRank, RngState
from multigpu.checkpoint.resume import decide, planned
from multigpu.run import Run, StepEvent, script_context
from multigpu.runtime.context import RunContext

_events: list = []


class _Record:
    def on_step(self, event: StepEvent) -> None:
        folder = event.run.checkpoints.path_for(event.step)
        _events.append((event.step, folder.exists(), sorted(event.state), event.state["rng"].__class__.__name__))


def record():
    return _Record()


def _state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "rng": PerRank(RngState())}


def _names(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_callbacks_see_one_event_before_their_steps_checkpoint_and_the_cadence_is_one_rule(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_events", [])
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "made_here.py").write_text(f"from {__name__} import record\n")
    run = Run(script_context(tmp_path / "run"), _state(), total=5, checkpoint_every=2, mode="sync",
              callbacks=["made_here:record"])
    assert [n for n in run.steps()] == [0, 1, 2, 3, 4]
    # every step, in order; the checkpoint of step 2 and 4 does not exist yet when its callback runs
    assert _events == [(s, False, ["model", "opt", "rng"], "RngState") for s in range(1, 6)]
    assert _names(tmp_path / "run") == ["step_00000002", "step_00000004", "step_00000005"]  # cadence + the last

    # resumed: from step 5, to 8; a step that asks to stop ends the steps, with its checkpoint
    again = Run(script_context(tmp_path / "run", "auto"), _state(), total=8, checkpoint_every=0, mode="async")
    assert again.start == again.step == 5
    for number in again.steps():
        if number == 5:
            again.stop("target reached")
    assert again.step == 6 and _names(tmp_path / "run") == ["step_00000004", "step_00000005", "step_00000006"]


def test_a_plain_script_and_a_job_decide_resume_by_one_rule_once(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    first = Run(script_context(run_dir), _state(), total=3, mode="sync")
    list(first.steps())
    newest = run_dir / "checkpoints" / "step_00000003"
    capsys.readouterr()

    script = Run(script_context(run_dir, "auto"), _state())  # a plain script: the run decides
    assert script.resume_from == newest and script.start == 3
    assert capsys.readouterr().out == f"resuming from {newest}\n"

    job = decide(RunContext(run_dir=str(run_dir), resume="auto"))  # the rank entry point decides ...
    assert job.resume_decided and job.resume_from == str(newest)
    capsys.readouterr()
    run = Run(job, _state())  # ... and the run does not decide again, nor say it twice
    assert run.resume_from == newest and capsys.readouterr().out == ""
    assert decide(dataclasses.replace(job, resume_from=None)).resume_from is None  # decided: "start fresh" stays

    # a worker group restarted by torchrun's agent resumes from the newest, whatever resume said
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = Run(script_context(run_dir), _state())
    assert restarted.resume_from == newest and f"restart 1: resuming from {newest}" in capsys.readouterr().out
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")

    # the launcher's look-ahead (no checksums read) names the folder the ranks take
    assert planned("auto", str(run_dir)) == newest and planned(None, str(run_dir)) is None
    assert planned(str(newest), None) == newest


def test_a_signal_ends_the_steps_after_the_current_one_with_its_checkpoint(single_rank_group, tmp_path):
    run = Run(script_context(tmp_path / "run"), _state(), total=100, checkpoint_every=0, checkpoint_last=False,
              mode="async", on_interrupt=True)
    for number in run.steps():
        if number == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # only recorded: nothing is written in the handler
    assert run.interrupted and run.signal == signal.SIGTERM and run.step == 3
    assert _names(tmp_path / "run") == ["step_00000003"]  # written and complete when steps() ends


def test_a_resume_past_the_steps_asked_for_is_one_line_not_a_run_that_does_nothing(tmp_path):
    """Issue 48: a plain script (or a worker group) resumed from step 5 with total=3 ran no step and ended as if it
    had; the launcher refuses a job so (Workload.resume_total), the run refuses the rest."""
    from multigpu.errors import ConfigError

    first = Run(script_context(tmp_path / "run"), _state(), total=5, mode="sync")
    assert list(first.steps()) == [0, 1, 2, 3, 4]
    again = Run(script_context(tmp_path / "run", "auto"), _state(), total=3, mode="sync")
    with pytest.raises(ConfigError, match=r"step_00000005 is at step 5, past the 3 steps this run is set to: "
                                          r"nothing would run; valid: more steps than 5"):
        list(again.steps())
    done = Run(script_context(tmp_path / "run", "auto"), _state(), total=5, mode="sync")
    assert list(done.steps()) == []  # a finished run resumed at its own end: nothing to run, and no error


def test_a_resumed_runs_log_points_fall_on_the_steps_an_uninterrupted_runs_do(single_rank_group, tmp_path):
    """One cadence for every workload: a log point after every ``log_every``-th step as the run counts them.
    Before, the meter counted from the resume: a run resumed at step 3 with log_every=2 logged steps 5 and 7 (the
    uninterrupted run: 2, 4, 6, 8), so the records of a resumed sim or rl run differed from an uninterrupted
    one's; each step's record once either way."""
    from tests.conftest import logged_steps

    def run(folder, total, resume=None):
        made = Run(script_context(tmp_path / folder, resume), _state(), total=total, log_every=2, mode="sync",
                   progress=False)
        if made.resume_from:
            made.load()
        list(made.steps())
        made.close()

    run("whole", 8)
    run("parts", 3)
    run("parts", 8, "auto")
    assert logged_steps(tmp_path / "parts") == logged_steps(tmp_path / "whole") == [2, 4, 6, 8]


def test_a_records_workload_figures_are_those_of_its_own_step(single_rank_group, tmp_path):
    """The log point comes after the workload's whole step. Before, a simulation's record was written as its meter
    step ended, before the step's series were read into it: the record of step 4 held the S, I and R of step 2 (the
    previous log point's), the first one none."""
    import csv
    import json

    from multigpu.sim.config import SimConfig
    from multigpu.sim.runner import run

    cfg = SimConfig(model="sir", agents=600, grid=(12, 12), steps=6, log_every=2, plot=False,
                    params={"initial_infected": 0.05})
    run(cfg, script_context(tmp_path / "sim"))
    with open(tmp_path / "sim" / "series.csv") as fh:
        series = {int(row["step"]): row for row in csv.DictReader(fh)}
    records = [json.loads(line) for line in (tmp_path / "sim" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]
    for record in records:
        assert {k: record.get(k) for k in ("S", "I", "R")} == {k: int(series[record["step"]][k]) for k in "SIR"}
