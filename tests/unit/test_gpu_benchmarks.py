"""The GPU benchmarks in their --quick mode on the CPU, so they never rot between GPU runs.

Each script runs ours and its peer on tiny sizes in a subprocess and must
write a record with both sides' figures and its targets (whatever their
values on a CPU); run_all.sh must parse, and collect.py must merge a record
and pytest's JUnit XML into the results file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

GPU = ROOT / "benchmarks" / "gpu"


def _quick(script: str, tmp_path, *extra: str) -> dict:
    out = tmp_path / f"{script}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(GPU / script), "--quick", "--json", str(out), *extra],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["machine"]["torch"] and isinstance(record["targets"], dict)
    return record


def test_train_mfu_quick_runs_both_loops(tmp_path):
    r = _quick("train_mfu.py", tmp_path)
    for side in ("ours", "peer"):
        assert r[side]["tokens_per_s"] > 0 and r[side]["final_loss"] > 0 and r[side]["params"] > 0
    assert r["ratio"] == pytest.approx(r["ours"]["tokens_per_s"] / r["peer"]["tokens_per_s"])
    assert set(r["targets"]) == {"mfu >= 0.40", "ratio >= 1.0"}


def test_sim_gpu_quick_measures_and_checks_the_digest(tmp_path):
    r = _quick("sim_gpu.py", tmp_path)
    assert r["ours"][0]["agent_steps_per_s"] > 0 and r["ours"][0]["agents"] == 100_000
    assert r["peer"]["same_digest"] and r["targets"]["same digest as the CPU"] is True


def test_envs_gpu_quick_measures_ours_and_gymnasium(tmp_path):
    pytest.importorskip("gymnasium")
    r = _quick("envs_gpu.py", tmp_path)
    assert r["ours"][0]["env_steps_per_s"] > 0
    gym = r["peer"][0]["gymnasium"]
    assert gym["env_steps_per_s"] > 0 and gym["procs"] == 2 and r["ratio"] > 0


def test_infer_gpu_quick_matches_monai(tmp_path):
    pytest.importorskip("monai")
    r = _quick("infer_gpu.py", tmp_path)
    assert r["ours"]["windows_per_s"] > 0 and r["peer"]["monai"]["windows_per_s"] > 0
    assert r["output_difference"] < 1e-4 and r["config"]["model"].startswith("BasicUNet")


def test_doctor_gpu_quick_and_the_run_script_parse(tmp_path):
    r = _quick("doctor_gpu.py", tmp_path)
    assert {c["name"] for c in r["ours"]["checks"]} >= {"torch", "GPUs", "NCCL"}
    for script in ("run_all.sh", "fetch_wheels.sh"):
        assert subprocess.run(["bash", "-n", str(GPU / script)], capture_output=True).returncode == 0, script


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
    subprocess.run([*collect, "--step", "tests", "--status", "failed", "--rc", "1", "--junit", str(junit)], check=True)
    subprocess.run([*collect, "--step", "sim", "--status", "skipped", "--note", "out of time"], check=True)
    data = json.loads(results.read_text())
    assert data["steps"]["train"]["record"]["benchmark"] == "train_mfu"
    assert data["steps"]["tests"]["tests"]["passed"] == 1
    assert data["steps"]["tests"]["tests"]["failing"] == [{"test": "tests.gpu.t::b", "kind": "failure",
                                                          "message": "assert 1 == 2"}]
    assert data["targets"] == {"train: ratio >= 1.0": True, "tests: every gpu test passed": False}
    assert data["steps"]["sim"] == {"status": "skipped", "rc": None, "seconds": None, "note": "out of time"}
