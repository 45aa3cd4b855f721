"""``multigpu sim`` end to end: bad input fails in the launcher; a run writes its outputs and resumes.

The resume test pins the contract that a checkpoint written by 2 ranks
(spatial) continues on 1 rank (data) to exactly the series a 1-process run
produces: the CSV must match row for row.
"""

from __future__ import annotations

import csv
import json
import os

import pytest

from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from tests.conftest import ROOT, assert_bad_input, run_cli

SIR = "sir"


@pytest.mark.parametrize(
    "args, message",
    [
        (["-f", SIR, "model=sri"], "sim.model 'sri' is not a known model"),
        (["-f", SIR, "--agents", "0"], "argument --agents: 0 is invalid"),
        (["-f", SIR, "agents=-5"], "sim.agents=-5 is invalid"),
        (["-f", SIR, "stps=5"], "Did you mean 'sim.steps'"),
        (["-f", SIR, "substeps=[movement,sneeze]"], "unknown substep 'sneeze'"),
        (["-f", SIR, "--strategy", "spatial", "--nproc-per-node", "4", "grid=[3,100]"], "fewer than the 4 ranks"),
        (["-f", "configs/nope.yaml"], "config file 'configs/nope.yaml' does not exist"),
        (["-f", SIR, "--resume", "/no/such/ckpt"], "is not a checkpoint folder"),
        (["-f", SIR, "--population", "/no/such/pop.npz"], "sim.population '/no/such/pop.npz' does not exist"),
        (["-f", SIR, "--save-agents", "out.csv"], "sim.save_agents 'out.csv': .csv is not written"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, monkeypatch, args, message):
    """In process through the real entry point (main), so each case costs milliseconds, not a Python start."""
    monkeypatch.chdir(ROOT)
    assert_bad_input(["sim", *args, "--run-dir", str(tmp_path / "run")], message, capsys, tmp_path / "run")


def test_bad_input_exit_code_from_a_real_process(tmp_path):
    result = run_cli("sim", "-f", SIR, "model=sri", "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: sim.model 'sri'"), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


def _csv(path):
    with open(path) as fh:
        return list(csv.reader(fh))


@pytest.mark.e2e
def test_sim_runs_on_two_ranks_checkpoints_and_resumes_on_one(tmp_path):
    run_dir = tmp_path / "run"
    common = ["-f", SIR, "--agents", "20000", "--run-dir", str(run_dir), "grid=[40,50]", "params.beta=0.3"]
    first = run_cli("sim", *common, "--steps", "6", "--nproc-per-node", "2", "--strategy", "spatial",
                    "--checkpoint-every", "3", "--profile", timeout=180)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "agent-steps/s" in first.stdout and "series:" in first.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_agents"] == 20000 and summary["bytes_per_agent"] == 9
    assert summary["throughput"] > 0 and (run_dir / "series.png").stat().st_size > 1000
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000003", "step_00000006"]
    assert "phase seconds" in (run_dir / "profile.txt").read_text()
    assert sorted(p.name for p in (run_dir / "profile").glob("rank*.json")) == ["rank0.json", "rank1.json"]

    second = run_cli("sim", *common, "--steps", "9", "--nproc-per-node", "1", "--strategy", "data",
                     "--resume", "auto", timeout=180)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = _csv(run_dir / "series.csv")

    cfg = SimConfig(model="sir", agents=20000, grid=(40, 50), steps=9,
                    params={**json.loads((run_dir / "run.json").read_text())["config"]["params"]})
    series = SimEngine(cfg).run()
    assert resumed[0] == list(series)
    assert resumed[1:] == [[str(v) for v in row] for row in zip(*series.values(), strict=True)]


@pytest.mark.e2e
def test_population_file_to_two_ranks_to_saved_agents(tmp_path):
    """file -> `multigpu sim --population` on 2 ranks (spatial) -> `--save-agents` = a one-process run of the file."""
    import numpy as np

    start = SimEngine(SimConfig(model="sir", agents=6000, grid=(40, 30), steps=2, params={"beta": 0.3}))
    start.run()
    pop = tmp_path / "pop.csv"
    agents = {k: v.numpy() for k, v in start.state.sorted_by_id().items()}
    rows = ["x,y,state"] + [f"{x},{y},{s}" for x, y, s in zip(agents["x"], agents["y"], agents["state"], strict=True)]
    pop.write_text("\n".join(rows) + "\n")
    proc = run_cli("sim", "-f", SIR, "--population", str(pop), "--steps", "4", "--nproc-per-node", "2",
                   "--strategy", "spatial", "--save-agents", "final.npz", "--run-dir", str(tmp_path / "run"),
                   "grid=[40,30]", "params.beta=0.3", "plot=false", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"agents: {tmp_path / 'run' / 'final.npz'}" in proc.stdout
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "run" / "final.npz").stat().st_mode & 0o777 == 0o666 & ~umask  # a named output: the user's
    resolved = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert resolved["agents"] == 6000 and resolved["population"] == str(pop)
    from multigpu.config import from_dict

    ref = SimEngine(from_dict(SimConfig, {**resolved, "strategy": "data", "save_agents": "", "compile": False}))
    ref.run()
    saved = np.load(tmp_path / "run" / "final.npz")
    for k, v in ref.state.sorted_by_id().items():
        assert np.array_equal(saved[k], v.numpy()), k
