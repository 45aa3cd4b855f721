"""`multigpu verify` passes a world-size independent example and fails a dependent one; `doctor --json` answers."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def test_verify_passes_when_results_do_not_depend_on_the_world_size():
    proc = run_cli("verify", "--nproc", "1,2,3", "examples/verify_independent.py", env={"COLUMNS": "200"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verify passed: 3 result(s) equal at 1, 2, 3 ranks (atol 0, rtol 0)" in proc.stdout
    assert proc.stdout.count("pass") >= 6  # 3 results x 2 world sizes, each compared with 1 rank


def test_verify_fails_naming_the_result_and_the_difference(tmp_path):
    keep = tmp_path / "results"
    proc = run_cli("verify", "--nproc", "1,3", "-o", str(keep), "examples/verify_dependent.py",
                   env={"COLUMNS": "200"}, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last == ("error: verify failed: 'mean' at 3 ranks vs 1: max abs difference 2.78, "
                    "max rel difference 0.0975 (atol 0, rtol 0)")
    assert sorted(p.name for p in (keep / "np3").iterdir()) == ["mean.pt", "total.pt"]  # rank 0 wrote, atomically


def _expected_doctor_statuses() -> dict[str, str]:
    """What each check must say on this machine, read here by the test itself (a CPU-only host, or GPUs; no
    visible-device or interface variables set; the thresholds of :mod:`multigpu.doctor.checks`)."""
    import resource
    import shutil
    import socket

    import psutil
    import torch

    from multigpu.doctor import checks

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        shm = shutil.disk_usage("/dev/shm").total
    except OSError:
        shm = None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft = soft if soft != resource.RLIM_INFINITY else 2**31
    stats, addrs = psutil.net_if_stats(), psutil.net_if_addrs()
    outside = [name for name, st in stats.items() if st.isup and name != "lo" and any(
        a.family == socket.AF_INET and not a.address.startswith("127.") for a in addrs.get(name, []))]
    return {
        "torch": "pass", "GPUs": "warn" if gpus == 0 else "pass", "driver / NVML": "pass", "NCCL": "pass",
        "gloo": "pass", "visible-device variables": "pass", "CPU ranks' heap": "pass",
        "/dev/shm": ("warn" if shm is None else "fail" if shm < checks.SHM_FAIL_BYTES else
                     "warn" if shm < checks.SHM_WARN_BYTES else "pass"),
        "open-file limit": ("fail" if soft < checks.NOFILE_FAIL else "warn" if soft < checks.NOFILE_WARN else "pass"),
        "rendezvous port": "pass", "network interfaces": "pass" if len(outside) == 1 else "warn",
        "all-reduce bandwidth": "pass", "training memory": "pass",
    }


def test_doctor_json_answers_every_check_on_this_machine():
    """Each check's exact status on this machine, not just one of pass/warn/fail: a check that warns or fails
    where all is well (or passes where it should warn) is caught."""
    env = {k: v for k, v in os.environ.items() if k not in (
        "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}
    proc = run_cli("doctor", "--json", timeout=180, env=env)
    report = json.loads(proc.stdout)  # stdout is pure JSON: the bandwidth test's workers write elsewhere
    checks = {c["name"]: c for c in report["checks"]}
    expected = _expected_doctor_statuses()
    if not torch.cuda.is_available():  # the GPU-only checks (P2P, NVLink, InfiniBand) are absent on a CPU host
        assert list(checks) == list(expected), list(checks)
    assert {name: checks[name]["status"] for name in expected} == expected, {n: c["detail"] for n, c in checks.items()}
    assert all(c["detail"] for c in checks.values())
    failed = [name for name, c in checks.items() if c["status"] == "fail"]  # exit 1 exactly when a check fails
    assert proc.returncode == (1 if failed else 0) and report["ok"] is (not failed), (failed, proc.stderr[-3000:])
    assert all(c["hint"] for c in checks.values() if c["status"] != "pass")
    assert checks["gloo"]["detail"] == "available"
    assert checks["torch"]["detail"].startswith(f"torch {torch.__version__.split('+')[0]}")
    bw = checks["all-reduce bandwidth"]  # 2 gloo ranks through the real launcher here
    assert report["facts"]["bandwidth"]["busbw_gbps"] > 0 and report["facts"]["bandwidth"]["world_size"] >= 2
    assert bw["detail"].startswith(f"busbw {report['facts']['bandwidth']['busbw_gbps']:.2f} GB/s")


def test_verify_keeps_a_failed_runs_logs_in_its_run_dir(tmp_path):
    """`verify --run-dir` keeps a failed run's logs in that folder, not in /tmp/multigpu_logs_*."""
    keep = tmp_path / "results"
    proc = run_cli("verify", "--nproc", "1,2", "-o", str(keep), "tests/scripts/fail_rank1.py", timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert f"full logs: {keep}/runs/np2/logs" in proc.stderr and "multigpu_logs_" not in proc.stderr
    assert list((keep / "runs" / "np2" / "logs").rglob("error.json"))


def test_verify_infer_compares_its_outputs_and_leaves_nothing_behind(tmp_path):
    """`verify --nproc 1,2 infer` ran 2 minutes, said "infer recorded no result at any world size" and left its
    ranks' temporary folders (23 MB) behind. infer records its outputs; every run's folder is verify's own."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = run_cli("verify", "--nproc", "1,2", "infer", env={"COLUMNS": "200", "TMPDIR": str(tmp)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verify passed: 1 result(s) equal at 1, 2 ranks (atol 0, rtol 0)" in proc.stdout
    assert "│ outputs │" in proc.stdout
    assert list(tmp.iterdir()) == []  # nothing left in the temporary folder
