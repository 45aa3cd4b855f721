"""`multigpu bench` plumbing with torch's elastic_launch mocked: what each run gets, and a run that measures nothing.

The fake launch plays the workload's StepMeter: it writes summary.json where MULTIGPU_RUN_DIR points.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

from multigpu.cli import main
from tests.conftest import ROOT

EXAMPLE = str(ROOT / "examples" / "allreduce_dp.py")


def _fake_run(seen: list, write: bool = True):
    def launch(config, entrypoint, args):
        run_dir = Path(os.environ["MULTIGPU_RUN_DIR"])
        seen.append({"nproc": config.nproc_per_node, "run_dir": run_dir.name, "args": list(args),
                     **{k: os.environ.get(k) for k in ("MULTIGPU_SCALING", "MULTIGPU_PROFILE", "CUDA_VISIBLE_DEVICES")}})
        if write:
            n = config.nproc_per_node
            run_dir.mkdir(parents=True, exist_ok=True)
            per_rank = [{"wall_s": 1.0, "comm_s": 0.1 * n, "busy_s": 1 - 0.1 * n, "items": 100, "steps": 5}] * n
            (run_dir / "summary.json").write_text(json.dumps({
                "unit": "samples", "world_size": n, "throughput": 100.0 * n ** 0.5, "comm_share": 0.1 * (n - 1),
                "imbalance": 1.0, "step_time_s": {"median": 0.1, "min": 0.1, "max": 0.1}, "per_rank": per_rank}))
    return launch


def test_each_world_size_and_repeat_gets_its_own_run_dir_scaling_and_devices(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MULTIGPU_FAKE_GPU_COUNT", "4")
    seen: list = []
    out = tmp_path / "bench"
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_fake_run(seen)):
        code = main(["bench", "--nproc", "2,1", "--weak", "--repeat", "2", "--gpus", "1,3", "--profile",
                     "-o", str(out), EXAMPLE, "--steps", "7"])
    assert code == 0
    assert [(s["nproc"], s["run_dir"]) for s in seen] == [(1, "np1_r0"), (1, "np1_r1"), (2, "np2_r0"), (2, "np2_r1")]
    assert {s["MULTIGPU_SCALING"] for s in seen} == {"weak"} and {s["MULTIGPU_PROFILE"] for s in seen} == {"1"}
    assert [s["CUDA_VISIBLE_DEVICES"] for s in seen] == ["1", "1", "1,3", "1,3"]  # the first N of --gpus
    assert all(s["args"][-3:] == [EXAMPLE, "--steps", "7"] for s in seen)
    assert "MULTIGPU_RUN_DIR" not in os.environ  # restored after each launch
    result = json.loads((out / "bench.json").read_text())
    assert result["scaling"] == "weak" and result["repeat"] == 2 and len(result["runs"]) == 4
    assert [r["world_size"] for r in result["rows"]] == [1, 2]
    assert "1.41x" in capsys.readouterr().out  # sqrt(2) speedup, as the fake measured


def test_a_script_that_measures_nothing_gets_told_how_to_fix_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MULTIGPU_FAKE_GPU_COUNT", "0")
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_fake_run([], write=False)):
        code = main(["bench", "--nproc", "1,2", "-o", str(tmp_path / "b"), EXAMPLE])
    err = capsys.readouterr().err
    assert code == 1 and "finished without writing" in err and "StepMeter" in err
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_fake_run([])):
        monkeypatch.setenv("MULTIGPU_FAKE_GPU_COUNT", "2")
        assert main(["bench", "--nproc", "1,8", "--gpus", "0,1", "-o", str(tmp_path / "c"), EXAMPLE]) == 2
    assert "--nproc 8 needs 8 GPUs but --gpus 0,1 selects 2" in capsys.readouterr().err


def test_launch_profile_flag_reaches_every_worker_environment(monkeypatch):
    monkeypatch.setenv("MULTIGPU_FAKE_GPU_COUNT", "0")
    seen = []
    with mock.patch("multigpu.launch.agent._elastic_launch",
                    side_effect=lambda *a: seen.append(os.environ.get("MULTIGPU_PROFILE"))):
        assert main(["launch", "--profile", EXAMPLE]) == 0
        assert main(["launch", EXAMPLE]) == 0
    assert seen == ["1", None]
