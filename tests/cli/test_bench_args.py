"""`multigpu bench` plumbing with torch's elastic_launch mocked: what each run gets, and a run that measures nothing.

The fake launch plays the workload's StepMeter: it writes summary.json into the run directory of the run file
the launcher wrote (or, for a script without a meter, the worker wrapper's wall times).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest

from multigpu.cli import main
from tests.conftest import ROOT, run_file

EXAMPLE = str(ROOT / "examples" / "allreduce_dp.py")


def _fake_run(seen: list, write: bool = True, wall: bool = False):
    def launch(config, entrypoint, args):
        run = run_file()["run"]
        run_dir = Path(run["run_dir"])
        seen.append({"nproc": config.nproc_per_node, "run_dir": run_dir.name, "args": list(args),
                     "scaling": run["scaling"], "profile": run["profile"], "record_wall": run["record_wall"],
                     "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")})
        if wall:  # what the worker wrapper writes for a script: rank r ran from 10 to 12 + r seconds
            (run_dir / "wall").mkdir(parents=True, exist_ok=True)
            for r in range(config.nproc_per_node):
                (run_dir / "wall" / f"rank{r}.json").write_text(json.dumps({"start": 10.0, "end": 12.0 + r}))
        elif write:
            n = config.nproc_per_node
            run_dir.mkdir(parents=True, exist_ok=True)
            per_rank = [{"wall_s": 1.0, "comm_s": 0.1 * n, "busy_s": 1 - 0.1 * n, "items": 100, "steps": 5}] * n
            (run_dir / "summary.json").write_text(json.dumps({
                "unit": "samples", "world_size": n, "throughput": 100.0 * n ** 0.5, "comm_share": 0.1 * (n - 1),
                "imbalance": 1.0, "step_time_s": {"median": 0.1, "min": 0.1, "max": 0.1}, "per_rank": per_rank}))
    return launch


def test_each_world_size_and_repeat_gets_its_own_run_dir_scaling_and_devices(tmp_path, fake_gpus, capsys):
    fake_gpus(4)
    seen: list = []
    out = tmp_path / "bench"
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_fake_run(seen)):
        code = main(["bench", "--nproc", "2,1", "--weak", "--repeat", "2", "--gpus", "1,3", "--profile",
                     "-o", str(out), EXAMPLE, "--steps", "7"])
    assert code == 0
    # repeats alternate the world sizes, so a drift of the machine hits both alike
    assert [(s["nproc"], s["run_dir"]) for s in seen] == [(1, "np1_r0"), (2, "np2_r0"), (1, "np1_r1"), (2, "np2_r1")]
    assert {s["scaling"] for s in seen} == {"weak"} and {s["profile"] for s in seen} == {True}
    assert [s["CUDA_VISIBLE_DEVICES"] for s in seen] == ["1", "1,3", "1", "1,3"]  # the first N of --gpus
    assert all(s["args"][-3:] == [EXAMPLE, "--steps", "7"] for s in seen)
    assert "MULTIGPU_RUN_FILE" not in os.environ  # restored after each launch
    result = json.loads((out / "bench.json").read_text())
    assert result["scaling"] == "weak" and result["repeat"] == 2 and len(result["runs"]) == 4
    assert [r["world_size"] for r in result["rows"]] == [1, 2]
    assert "1.41x" in capsys.readouterr().out  # sqrt(2) speedup, as the fake measured


def test_a_script_without_a_meter_is_measured_by_its_wall_clock(tmp_path, fake_gpus, capsys):
    """A plain script gets a scaling table from the worker wrapper's start/end times (slowest rank), and says so."""
    fake_gpus(0)
    seen: list = []
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_fake_run(seen, wall=True)):
        assert main(["bench", "--nproc", "1,2", "-o", str(tmp_path / "w"), EXAMPLE]) == 0
    assert {s["record_wall"] for s in seen} == {True}
    result = json.loads((tmp_path / "w" / "bench.json").read_text())
    assert [r["summary"]["measure"] for r in result["runs"]] == ["wall", "wall"]
    assert [r["summary"]["wall_s"] for r in result["runs"]] == [2.0, 3.0]  # first start to last end
    assert result["rows"][1]["speedup"] == 2.0 / 3.0
    assert result["notes"][0].startswith("measured by wall clock")
    # what a wall clock cannot see is not measured: None in bench.json, "—" in the table, never 0
    assert {(r["comm_share"], r["imbalance"], r["compute_per_item_s"]) for r in result["rows"]} == {(None, None, None)}
    out = capsys.readouterr().out
    assert "measured by wall clock" in out and "they need a StepMeter" in out
    scaling = out.split("start-up: from the command")[0]  # the scaling table (the start-up table follows it)
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in scaling.splitlines() if line.startswith("│")]
    rows = [c for c in cells if c and c[0].isdigit()]
    assert [r[-2:] for r in rows] == [["—", "—"], ["—", "—"]]  # comm share, imbalance
    assert [r[1] for r in rows] == ["0.5", "0.333"]  # runs/s with its digits (1 run in 2 s, 1 in 3 s), not "0"
    from multigpu.report.html import build_report

    page = build_report(tmp_path / "w")  # report/ reads the None figures too
    scaling_page = page.split("<h3>Start-up: from the command")[0]  # the start-up table's own — follow
    assert scaling_page.count("<td class=num>—</td>") == 4  # comm share and imbalance of both rows


def test_a_run_that_leaves_no_figures_is_an_error(tmp_path, fake_gpus, capsys):
    fake_gpus(0)
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_fake_run([], write=False)):
        code = main(["bench", "--nproc", "1,2", "-o", str(tmp_path / "b"), EXAMPLE])
    err = capsys.readouterr().err
    assert code == 1 and "finished without writing" in err and "wall times" in err
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_fake_run([])):
        fake_gpus(2)
        assert main(["bench", "--nproc", "1,8", "--gpus", "0,1", "-o", str(tmp_path / "c"), EXAMPLE]) == 2
    assert "--nproc 8 needs 8 GPUs but --gpus 0,1 selects 2" in capsys.readouterr().err


def test_launch_profile_flag_reaches_every_worker_through_the_run_file(fake_gpus):
    fake_gpus(0)
    seen = []
    with mock.patch("multigpu.launch.agent._elastic_launch",
                    side_effect=lambda *a: seen.append(run_file()["run"])):
        assert main(["launch", "--profile", "--profile-steps", "0,1,2", "--sample-interval-s", "0.5", EXAMPLE]) == 0
        assert main(["launch", EXAMPLE]) == 0
    assert [(r["profile"], r["profile_steps"], r["sample_interval_s"]) for r in seen] == [
        (True, [0, 1, 2], 0.5), (False, [1, 1, 3], 1.0)]


def _config_seen(seen: list):
    base = _fake_run([])

    def launch(config, entrypoint, args):
        data = run_file()
        folder = data["run"]["run_dir"] or data["run"]["verify_dir"]  # verify's runs have no run directory
        seen.append({"nproc": config.nproc_per_node, "scaling": data["run"]["scaling"], "config": data["config"],
                     "run_dir": Path(folder).parent.name})
        if data["run"]["run_dir"]:
            base(config, entrypoint, args)
    return launch


@pytest.mark.parametrize("order", [
    ["train", "--nproc", "1,2", "-f", "nano", "steps=3", "--grad-accum", "2", "--weak"],   # the order a user wrote
    ["--nproc", "1,2", "train", "steps=3", "-f", "nano", "--weak", "--grad-accum", "2"],
    ["-f", "nano", "--weak", "train", "--grad-accum", "2", "--nproc", "1,2", "steps=3"],
    ["--weak", "train", "--set", "steps=3", "--nproc=1,2", "--grad_accum=2"],
])
def test_bench_takes_a_workloads_command_line_in_any_order(order, tmp_path, fake_gpus, capsys):
    """What follows a workload's name is read as `multigpu train` reads it, with bench's and the launcher's flags."""
    fake_gpus(0)
    seen: list = []
    out = tmp_path / "b"
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_config_seen(seen)):
        code = main(["bench", *order, "-o", str(out)])
    assert code == 0, capsys.readouterr().err
    assert [s["nproc"] for s in seen] == [1, 2] and {s["scaling"] for s in seen} == {"weak"}
    assert {(s["config"]["steps"], s["config"]["grad_accum"]) for s in seen} == {(3, 2)}  # the user's beat bench's
    assert {s["config"]["eval_every"] for s in seen} == {0}  # bench's own shorter-run overrides still apply
    assert {s["run_dir"] for s in seen} == {"b"}


def test_verify_takes_a_workloads_command_line_after_its_name(tmp_path, fake_gpus, capsys):
    fake_gpus(0)
    seen: list = []
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_config_seen(seen)):
        code = main(["verify", "train", "--nproc", "1,2", "--rtol", "0.5", "steps=3", "-f", "nano", "--cpu",
                     "-o", str(tmp_path / "v")])
    assert code == 1  # the fake ranks record nothing: verify says so, after running both sizes
    assert "recorded no result" in capsys.readouterr().err
    assert [(s["nproc"], s["config"]["steps"]) for s in seen] == [(1, 3), (2, 3)]


def test_a_scripts_arguments_stay_its_own_and_nproc_is_asked_for_where_it_belongs(tmp_path, fake_gpus, capsys):
    fake_gpus(0)
    seen: list = []
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=_fake_run(seen)):
        assert main(["bench", "-o", str(tmp_path / "s"), EXAMPLE, "--nproc", "1,2"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--nproc is required before the script" in err
        assert main(["bench", "--nproc", "1,2", "-f", "nano", "-o", str(tmp_path / "s"), EXAMPLE]) == 2
        assert "is a workload's config" in capsys.readouterr().err
        assert main(["bench", "train", "-o", str(tmp_path / "s"), "steps=3"]) == 2
        assert "--nproc is required: the world sizes to bench" in capsys.readouterr().err
    assert seen == [] and not (tmp_path / "s").exists()


def test_verify_runs_every_world_size_with_the_same_threads_per_rank(fake_gpus, monkeypatch, capsys):
    """A kernel whose float result depends on its thread count (oneDNN's convolutions on some CPUs: 2.9e-6 seen
    between a 2-thread rank and a 1-thread one) must not pass for a dependence on the world size."""
    from unittest import mock

    from multigpu.cli import main
    from multigpu.runtime.env import cpu_count
    from tests.conftest import SCRIPTS

    fake_gpus(0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    seen = []
    with mock.patch("multigpu.launch.agent._elastic_launch",
                    side_effect=lambda *a: seen.append(__import__("os").environ.get("OMP_NUM_THREADS"))):
        main(["verify", "--nproc", "1,2", str(SCRIPTS / "allreduce_loop.py")])  # records nothing: exit 1
    assert seen == [str(max(1, cpu_count() // 2))] * 2
    assert "thread(s) per rank at every world size (--threads to choose)" in capsys.readouterr().err
    seen.clear()
    with mock.patch("multigpu.launch.agent._elastic_launch",
                    side_effect=lambda *a: seen.append(__import__("os").environ.get("OMP_NUM_THREADS"))):
        main(["verify", "--nproc", "1,2", "--threads", "3", str(SCRIPTS / "allreduce_loop.py")])
    assert seen == ["3", "3"]
