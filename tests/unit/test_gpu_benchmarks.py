"""The GPU call rehearsed on the CPU (``REHEARSE=1 bash benchmarks/gpu/run_all.sh``), so it never rots between GPU runs.

The rehearsal runs every benchmark's --quick variant (ours and its peer on tiny sizes, each writing a record
with both sides' figures and its targets, whatever their values on a CPU) and checks each step's own estimate
of its GPU run against its cap; run_all.sh must parse, and collect.py must merge a record and pytest's JUnit
XML into the results file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

GPU = ROOT / "benchmarks" / "gpu"
SLOW = pytest.mark.slow  # the rehearsal: about a minute of set-up on 2 cores, in `make test`, not `make test-quick`


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """``REHEARSE=1 bash benchmarks/gpu/run_all.sh``, once: every step's --quick variant on the CPU, the GPU tests
    collected, each step's estimate of its GPU run checked against its cap (benchmarks/gpu/budget.py)."""
    out = tmp_path_factory.mktemp("rehearsal")
    env = {**os.environ, "PYTHON": sys.executable, "REHEARSE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(GPU / "run_all.sh"), str(out)], capture_output=True, text=True, timeout=900,
                          cwd=ROOT, env=env)
    return proc, json.loads((out / "gpu_results.json").read_text()), out


@SLOW
def test_the_rehearsal_runs_every_step_and_each_fits_its_cap(rehearsal):
    """The whole GPU call rehearsed on a CPU, as ``make test`` runs it: a script that breaks, or a step whose own
    estimate of its GPU run exceeds its cap, fails here instead of in the one GPU call."""
    proc, results, out = rehearsal
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    steps = results["steps"]
    assert set(steps) == {"smoke", "train", "sim", "infer", "envs", "doctor"}, steps
    assert {s["status"] for s in steps.values()} == {"ok"} and all(s["torch"] for s in steps.values())
    budget = [line for line in proc.stdout.splitlines() if line.startswith("budget ")]
    assert len(budget) == 9 and all("(fits)" in line for line in budget), budget
    for step in steps.values():
        assert step["record"]["machine"]["torch"] and isinstance(step["record"]["targets"], dict)
    smoke = steps["smoke"]["record"]
    assert [c["name"] for c in smoke["checks"]] == ["nccl_all_reduce", "ddp_step", "fsdp_step", "infer_cuda_input",
                                                    "sim_step", "env_step"] and all(c["ok"] for c in smoke["checks"])
    assert (out / "gpu_results.md").exists() and "| smoke |" in (out / "gpu_results.md").read_text()


@SLOW
def test_train_mfu_quick_runs_both_loops(rehearsal):
    r = rehearsal[1]["steps"]["train"]["record"]
    for side in ("ours", "peer"):
        assert r[side]["tokens_per_s"] > 0 and r[side]["final_loss"] > 0 and r[side]["params"] > 0
    assert r["ratio"] == pytest.approx(r["ours"]["tokens_per_s"] / r["peer"]["tokens_per_s"])
    assert set(r["targets"]) == {"mfu >= 0.40", "ratio >= 1.0"}


@SLOW
def test_sim_gpu_quick_measures_and_checks_the_digest(rehearsal):
    r = rehearsal[1]["steps"]["sim"]["record"]
    assert r["ours"][0]["agent_steps_per_s"] > 0 and r["ours"][0]["agents"] == 100_000
    assert r["peer"]["same_digest"] and r["targets"]["same digest as the CPU"] is True


def _installed(name: str):
    """Skip unless ``name`` is installed, without importing it here (MONAI's import takes seconds: the rehearsal's
    step imported it already, and this process has no use for it)."""
    return pytest.mark.skipif(importlib.util.find_spec(name) is None, reason=f"{name} is not installed")


@_installed("gymnasium")
@SLOW
def test_envs_gpu_quick_measures_ours_and_gymnasium(rehearsal):
    r = rehearsal[1]["steps"]["envs"]["record"]
    assert r["ours"][0]["env_steps_per_s"] > 0
    gym = r["peer"][0]["gymnasium"]
    assert gym["env_steps_per_s"] > 0 and gym["procs"] == 2 and r["ratio"] > 0


@_installed("monai")
@SLOW
def test_infer_gpu_quick_matches_monai(rehearsal):
    r = rehearsal[1]["steps"]["infer"]["record"]
    assert r["ours"]["windows_per_s"] > 0 and r["peer"]["monai"]["windows_per_s"] > 0
    assert r["output_difference"] < 1e-4 and r["config"]["model"].startswith("BasicUNet")


@SLOW
def test_doctor_gpu_quick_and_the_run_script_parse(rehearsal):
    r = rehearsal[1]["steps"]["doctor"]["record"]
    assert {c["name"] for c in r["ours"]["checks"]} >= {"torch", "GPUs", "NCCL"}
    for script in ("run_all.sh", "fetch_wheels.sh"):
        assert subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True).returncode == 0, script


def test_a_step_whose_estimate_exceeds_its_cap_fails_the_budget():
    """What the rehearsal would catch: train's cap lowered under its estimate (or its arguments raised)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "TRAIN_S": "40", "SIM_ARGS": "--sizes 1e8,1e9,1e10"}
    proc = subprocess.run([sys.executable, str(GPU / "budget.py"), "--steps", "train", "sim", "doctor"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("budget train: estimate 58 s of cap 40 s (OVER)")
    assert "(OVER)" in lines[1] and "1e+10 agents" in lines[1] and "(fits)" in lines[2]
    assert "train, sim would not fit its cap" in proc.stderr


def test_collect_merges_records_and_junit(tmp_path):
    results, record, junit = tmp_path / "r.json", tmp_path / "train.json", tmp_path / "j.xml"
    record.write_text(json.dumps({"benchmark": "train_mfu", "targets": {"ratio >= 1.0": True}}))
    junit.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                     '<testcase classname="tests.gpu.t" name="a"/>'
                     '<testcase classname="tests.gpu.t" name="b"><failure message="assert 1 == 2">x</failure></testcase>'
                     '<testcase classname="tests.gpu.t" name="c"><skipped message="needs 1 CUDA GPU(s)"/></testcase>'
                     '</testsuite></testsuites>')
    collect = [sys.executable, str(GPU / "collect.py"), str(results)]
    subprocess.run([*collect, "--step", "train", "--status", "ok", "--rc", "0", "--seconds", "5", "--record",
                    str(record)], check=True)
    subprocess.run([*collect, "--step", "tests_work", "--status", "failed", "--rc", "1", "--junit", str(junit)],
                   check=True)
    subprocess.run([*collect, "--step", "sim", "--status", "skipped", "--note", "out of time"], check=True)
    data = json.loads(results.read_text())
    assert data["steps"]["train"]["record"]["benchmark"] == "train_mfu"
    assert data["steps"]["tests_work"]["tests"]["passed"] == 1
    assert data["steps"]["tests_work"]["tests"]["failing"] == [{"test": "tests.gpu.t::b", "kind": "failure",
                                                          "message": "assert 1 == 2"}]
    assert data["targets"] == {"train: ratio >= 1.0": True, "tests_work: every gpu test passed": False}
    # every step's entry says which torch ran it (run_all.sh sets TORCH_VERSION; none here)
    assert data["steps"]["sim"] == {"status": "skipped", "rc": None, "seconds": None, "note": "out of time",
                                    "torch": os.environ.get("TORCH_VERSION")}
