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
import time
from datetime import datetime

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
    """The whole GPU call rehearsed on a CPU, as ``make test`` runs it: a script that breaks, a step whose own
    estimate of its GPU run exceeds its cap, or steps whose estimates together exceed one call, fail here instead of
    in the one GPU call; and every step's entry says which source and GPU ran it and when it started."""
    proc, results, out = rehearsal
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    steps = results["steps"]
    assert list(steps) == ["smoke", "train", "sim", "infer", "envs", "ppo", "checkpoint", "doctor"], steps
    assert {s["status"] for s in steps.values()} == {"ok"} and all(s["torch"] for s in steps.values())
    budget = [line for line in proc.stdout.splitlines() if line.startswith("budget ")]
    assert len(budget) == 12 and all("(fits)" in line for line in budget), budget  # 11 steps and the whole call
    assert budget[-1].startswith("budget call: ")
    source = json.loads(subprocess.run([sys.executable, str(GPU / "source.py")], capture_output=True, text=True,
                                       check=True, timeout=60).stdout)
    assert source["commit"] and results["source"]["commit"] == source["commit"]
    starts = [datetime.strptime(s["started"], "%Y-%m-%dT%H:%M:%S%z") for s in steps.values()]
    assert starts == sorted(starts) and starts[0] >= datetime.strptime(results["started"], "%Y-%m-%dT%H:%M:%S%z")
    for step in steps.values():
        assert step["commit"] == results["source"]["text"] and step["commit"].startswith(source["commit"][:12])
        assert step["gpu"] == "none (no GPU)" and step["call"] == results["started"]
        assert step["record"]["machine"]["torch"] and isinstance(step["record"]["targets"], dict)
        assert step["record"]["machine"]["commit"] == step["commit"]
    smoke = steps["smoke"]["record"]
    assert [c["name"] for c in smoke["checks"]] == ["nccl_all_reduce", "ddp_wrappers", "fsdp_wrapper", "hsdp_wrapper",
                                                    "checkpoint_ddp", "checkpoint_fsdp", "infer_cuda_input", "sim_step",
                                                    "env_step", "fakepg_2", "fakepg_4", "fakepg_8"]
    assert all(c["ok"] for c in smoke["checks"]), [c for c in smoke["checks"] if not c["ok"]]
    fake = {c["name"]: c for c in smoke["checks"]}
    for n in (2, 4, 8):  # rank 0's shard of the model at each world size: FSDP 1/n, HSDP 2/n, DDP all of it
        assert fake[f"fakepg_{n}"]["ddp_share"] == 1.0
        assert abs(fake[f"fakepg_{n}"]["fsdp_share"] - 1 / n) < 0.01
        assert abs(fake[f"fakepg_{n}"]["hsdp_share"] - 2 / n) < 0.01
    assert fake["checkpoint_fsdp"]["files"][:2] == [".metadata", "__0_0.distcp"] and fake["checkpoint_ddp"]["exact"]
    assert (out / "gpu_results.md").exists() and "| smoke |" in (out / "gpu_results.md").read_text()


@SLOW
def test_train_mfu_quick_runs_both_loops(rehearsal):
    r = rehearsal[1]["steps"]["train"]["record"]
    for side in ("ours", "peer"):
        assert r[side]["tokens_per_s"] > 0 and r[side]["final_loss"] > 0 and r[side]["params"] > 0
    assert r["ratio"] == pytest.approx(r["ours"]["tokens_per_s"] / r["peer"]["tokens_per_s"])
    assert set(r["targets"]) == {"mfu >= 0.45", "ratio >= 1.0"}


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
def test_ppo_gpu_quick_trains_with_the_policy_in_the_loop(rehearsal):
    r = rehearsal[1]["steps"]["ppo"]["record"]
    cfg = r["config"]
    assert [row["run"] for row in r["ours"]] == ["speed"] * len(cfg["sizes"]) + ["solve"]
    for row, n in zip(r["ours"], cfg["sizes"], strict=False):  # the speed runs: every update done, all timed
        assert row["num_envs"] == n and row["env_steps"] == n * 16 * cfg["updates"] and row["env_steps_per_s"] > 0
    assert r["ours"][-1]["num_envs"] == cfg["solve_envs"] and r["ours"][-1]["episodes"] > 0
    assert set(r["targets"]) == {"training env-steps/s >= 4e6", "solves CartPole-v1 (mean return 475)"}
    assert r["ratio"] == max(row["env_steps_per_s"] for row in r["ours"][:-1]) / 4e6


@SLOW
def test_checkpoint_gpu_quick_runs_checkpoint_async_as_a_step(rehearsal):
    r = rehearsal[1]["steps"]["checkpoint"]["record"]
    assert [(row["model"], row["mode"]) for row in r["ours"]] == [("big", "sync"), ("big", "async")]
    assert all(row["checkpoints"] >= 1 and row["write MB/s"] > 0 and row["disk MB/s"] > 0 for row in r["ours"])
    assert set(r["targets"]) == {"big: async stall <= 5% of sync", "big: async write >= 70% of the disk"}
    assert r["config"]["placement"] == "2 CPU ranks, gloo"


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
    # every step's entry says which torch, source and GPU ran it (run_all.sh sets GPU_RUN_SOURCE and collect.py
    # --meta the machine; none here), when it started and in which call
    assert data["steps"]["sim"] == {"status": "skipped", "rc": None, "seconds": None, "note": "out of time",
                                    "torch": os.environ.get("TORCH_VERSION"), "started": None,
                                    "call": data["started"], "gpu": "none (no GPU)",
                                    "commit": "unknown: GPU_RUN_SOURCE not set (run through run_all.sh)"}


def _sim_gpu(tmp_path, budget_s: int, sizes: str) -> tuple[float, list[str], dict]:
    """sim_gpu.py as run_all.sh runs it (children in subprocesses), on the CPU, with ``budget_s`` for its step:
    (its wall seconds, the lines it printed, its record)."""
    out = tmp_path / f"sim_{budget_s}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "STEP_BUDGET_S": str(budget_s), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(GPU / "sim_gpu.py"), "--device", "cpu", "--sizes", sizes, "--steps", "1",
                           "--check-agents", "1e4", "--json", str(out)], capture_output=True, text=True, timeout=180,
                          cwd=ROOT, env=env)
    return time.perf_counter() - start, proc.stdout.splitlines(), json.loads(out.read_text())


def test_sim_gpu_checks_the_digest_first_and_keeps_within_its_step(tmp_path):
    """The first GPU call's sim step: every child got at least 5 s whatever was left (40 + 5 + 5 s in a 55 s step),
    and the CPU-vs-GPU digest check ran last, so the cut step kept no digest. Now the digest check runs first, each
    child gets what is left less what the later ones need at least, and a child that cannot have that is recorded
    as not run instead of started: the step ends within its budget either way."""
    # room for both (the digest first, then the size) also on a loaded 2-core machine: with 26 s, four test
    # workers' load left the digest's child without its time (the step still ended within it)
    wall, lines, record = _sim_gpu(tmp_path, 45, "1e5")
    said = [i for i, line in enumerate(lines) if "digest" in line or "agent-steps/s" in line]
    assert said and "digest" in lines[said[0]] and "agent-steps/s" in lines[said[-1]], lines
    assert record["peer"]["same_digest"] and record["ours"][0]["agent_steps_per_s"] > 0 and wall <= 45 + 3, (
        wall, lines, record)
    wall, lines, record = _sim_gpu(tmp_path, 8, "1e5,1e5")  # no room: nothing started, the step ends in time
    assert wall <= 8 + 3, (wall, lines)
    assert record["peer"]["error"].startswith("not run") and all(r["error"].startswith("not run") for r in record["ours"])
    assert record["targets"] == {"agent-steps/s >= 1e10": None, "same digest as the CPU": None}
