"""doctor: each check is a pure function of Facts; broken setups fail the right check, with a hint."""

from __future__ import annotations

import dataclasses

import pytest

from multigpu.doctor import Facts, Interface, run_checks
from multigpu.doctor.bandwidth import bus_bandwidth
from multigpu.doctor.checks import (
    check_bandwidth,
    check_device_vars,
    check_driver,
    check_gpus,
    check_nccl,
    check_network,
    check_open_files,
    check_port,
    check_shm,
    check_torch,
)

HEALTHY_GPU = Facts(
    cuda_build="12.8", gpus=("NVIDIA H100",) * 2, nvml_installed=True, nvml_driver="570.1",
    nvml_gpus=("NVIDIA H100",) * 2, nccl_available=True, nccl_version="2.27.3",
    interfaces=(Interface("lo", True, ("127.0.0.1",)), Interface("eth0", True, ("10.0.0.5",))),
    bandwidth={"world_size": 2, "backend": "nccl", "size_bytes": 16 * 2**20, "seconds": 0.001,
               "algbw_gbps": 16.8, "busbw_gbps": 16.8},
)


def _status(results):
    return {r.name: r.status for r in results}


def test_a_healthy_gpu_machine_passes_every_check():
    results = run_checks(HEALTHY_GPU)
    assert len(results) == 13 and all(r.status == "pass" for r in results), [r for r in results if r.status != "pass"]
    assert "2x NVIDIA H100" in check_gpus(HEALTHY_GPU).detail and "NCCL 2.27.3" in check_nccl(HEALTHY_GPU).detail


def test_the_faked_broken_setup_fails_the_right_checks_with_hints():
    broken = dataclasses.replace(
        HEALTHY_GPU, nccl_available=False, nccl_version=None, shm_bytes=64 * 2**20,
        env={"CUDA_VISIBLE_DEVICES": "0", "TI_VISIBLE_DEVICE": "1", "EGL_DEVICE_ID": "0"},
    )
    results = {r.name: r for r in run_checks(broken)}
    failed = {name for name, r in results.items() if r.status == "fail"}
    assert failed == {"NCCL", "/dev/shm", "visible-device variables"}
    assert "--isolate-devices" in results["visible-device variables"].hint
    assert "TI_VISIBLE_DEVICE='1'" in results["visible-device variables"].detail
    assert "--shm-size" in results["/dev/shm"].hint and "64 MiB" in results["/dev/shm"].detail
    assert "CUDA build of torch" in results["NCCL"].hint and "--cpu" in results["NCCL"].hint


@pytest.mark.parametrize(("env", "status", "words"), [
    ({}, "pass", "none set"),
    ({"CUDA_VISIBLE_DEVICES": "3", "QD_VISIBLE_DEVICE": "3", "TI_VISIBLE_DEVICE": "3", "EGL_DEVICE_ID": "3"}, "pass", "agree"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "EGL_DEVICE_ID": "1"}, "pass", "agree"),
    ({"QD_VISIBLE_DEVICE": "0", "TI_VISIBLE_DEVICE": "2"}, "fail", "different GPUs"),
    ({"CUDA_VISIBLE_DEVICES": "0,1", "EGL_DEVICE_ID": "2"}, "fail", "hides"),
    ({"CUDA_VISIBLE_DEVICES": ""}, "warn", "hides all 2"),
    # issue 48: CUDA stops reading the list at the first entry that is not an index or a UUID (none visible here)
    ({"CUDA_VISIBLE_DEVICES": "garbage"}, "fail", "CUDA_VISIBLE_DEVICES='garbage': 'garbage' is not a GPU index or "
                                                  "UUID, and CUDA reads no further: no GPU is visible"),
    ({"CUDA_VISIBLE_DEVICES": "0,gpu1,1"}, "fail", "'gpu1' is not a GPU index or UUID, and CUDA reads no further: "
                                                   "only 0 is visible"),
    ({"CUDA_VISIBLE_DEVICES": "GPU-8f2a,MIG-1c3d, 1"}, "pass", "agree"),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, "warn", "no GPU is visible"),  # hiding them on purpose
])
def test_device_variables_agree_or_not(env, status, words):
    r = check_device_vars(dataclasses.replace(HEALTHY_GPU, env=env))
    assert r.status == status and words in r.detail


def test_gpu_driver_and_torch_build_problems():
    cpu_torch = dataclasses.replace(HEALTHY_GPU, cuda_build=None, gpus=())
    assert check_gpus(cpu_torch).status == "fail" and "CPU-only build" in check_gpus(cpu_torch).hint
    mixed = dataclasses.replace(HEALTHY_GPU, gpus=("NVIDIA A100", "NVIDIA V100", "NVIDIA A100"))
    assert check_gpus(mixed).status == "warn" and "2x NVIDIA A100, 1x NVIDIA V100" in check_gpus(mixed).detail
    assert check_gpus(Facts()).status == "warn"  # no GPU at all: CPU ranks, said plainly
    no_nvml = dataclasses.replace(HEALTHY_GPU, nvml_installed=False, nvml_driver=None, nvml_gpus=())
    assert check_driver(no_nvml).status == "warn" and "multigpu[gpu]" in check_driver(no_nvml).hint
    assert check_driver(Facts()).status == "pass"
    assert check_torch(dataclasses.replace(HEALTHY_GPU, torch_version="2.1.2")).status == "fail"
    assert check_nccl(Facts()).status == "pass"  # no GPU: gloo, NCCL not needed


def test_limits_port_network_and_bandwidth():
    assert check_open_files(dataclasses.replace(HEALTHY_GPU, nofile=(256, 4096))).status == "fail"
    assert check_open_files(dataclasses.replace(HEALTHY_GPU, nofile=(1024, 1024))).status == "warn"
    assert check_shm(dataclasses.replace(HEALTHY_GPU, shm_bytes=512 * 2**20)).status == "warn"
    no_port = check_port(dataclasses.replace(HEALTHY_GPU, free_port=None, port_error="Permission denied"))
    assert no_port.status == "fail" and "Permission denied" in no_port.detail
    wrong_if = check_network(dataclasses.replace(HEALTHY_GPU, env={"NCCL_SOCKET_IFNAME": "ib"}))
    assert wrong_if.status == "fail" and "up: lo, eth0" in wrong_if.detail
    assert check_network(dataclasses.replace(HEALTHY_GPU, env={"NCCL_SOCKET_IFNAME": "^docker,lo"})).status == "pass"
    assert check_network(dataclasses.replace(HEALTHY_GPU, env={"GLOO_SOCKET_IFNAME": "eth"})).status == "fail"  # exact names
    two = dataclasses.replace(HEALTHY_GPU, interfaces=(*HEALTHY_GPU.interfaces, Interface("ib0", True, ("10.1.0.5",))))
    assert check_network(two).status == "warn" and "NCCL_SOCKET_IFNAME=eth0" in check_network(two).hint
    failed = check_bandwidth(dataclasses.replace(HEALTHY_GPU, bandwidth=None, bandwidth_error="rank 1 died"))
    assert failed.status == "fail" and "rank 1 died" in failed.detail
    slow = dict(HEALTHY_GPU.bandwidth, busbw_gbps=0.2)
    assert check_bandwidth(dataclasses.replace(HEALTHY_GPU, bandwidth=slow)).status == "warn"
    assert check_bandwidth(Facts(bandwidth_skipped=True)).status == "warn"


def test_bus_bandwidth_follows_nccl_tests():
    algbw, busbw = bus_bandwidth(size_bytes=8 * 10**9, seconds=2.0, world_size=4)
    assert algbw == pytest.approx(4.0) and busbw == pytest.approx(4.0 * 2 * 3 / 4)
    assert bus_bandwidth(10**9, 1.0, 2) == pytest.approx((1.0, 1.0))


def test_training_memory_says_where_fsdp_is_needed():
    from multigpu.doctor.checks import check_training_memory

    h100 = check_training_memory(dataclasses.replace(HEALTHY_GPU, device_memory_bytes=80 * 2**30))
    assert "up to ~5.4B parameters on one NVIDIA H100 (80 GiB)" in h100.detail and "--strategy fsdp" in h100.hint
    assert check_training_memory(dataclasses.replace(HEALTHY_GPU, device_memory_bytes=None)).status == "pass"


@pytest.mark.parametrize("statuses,code", [(("pass", "warn"), 0), (("pass", "fail", "warn"), 1)])
def test_doctor_exits_1_exactly_when_a_check_fails(statuses, code, capsys, monkeypatch):
    """The command's exit code and its JSON's ``ok``, from the checks' statuses (the e2e test can see only what
    this machine's checks give: no failure here)."""
    import json

    import multigpu.doctor
    from multigpu.cli import main
    from multigpu.doctor.checks import CheckResult

    results = [CheckResult(f"check {i}", s, "found", "" if s == "pass" else "do this") for i, s in enumerate(statuses)]
    monkeypatch.setattr(multigpu.doctor, "gather_facts", lambda bandwidth: HEALTHY_GPU)
    monkeypatch.setattr(multigpu.doctor, "run_checks", lambda facts: results)
    assert main(["doctor", "--json"]) == code
    assert json.loads(capsys.readouterr().out)["ok"] is (code == 0)
    assert main(["doctor"]) == code
    assert f"{statuses.count('fail')} failed" in capsys.readouterr().out


@pytest.mark.parametrize(("glibc", "env", "words"), [
    ("2.36", {}, "glibc 2.36: CPU ranks keep blocks up to 128 MiB for reuse"),
    ("2.36", {"MALLOC_TRIM_THRESHOLD_": "0"}, "yours, kept for CPU ranks: MALLOC_TRIM_THRESHOLD_=0"),
    ("2.36", {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}, "yours, kept for CPU ranks: LD_PRELOAD=/usr/lib/libjemalloc.so.2"),
    ("2.36", {"LD_PRELOAD": "/opt/libfoo.so"}, "glibc 2.36: CPU ranks keep"),  # a preload that is no allocator
    (None, {}, "not glibc"),
])
def test_the_cpu_heap_line_says_what_cpu_ranks_will_get(glibc, env, words):
    from multigpu.doctor.checks import check_cpu_heap

    result = check_cpu_heap(dataclasses.replace(HEALTHY_GPU, glibc=glibc, env=env))
    assert result.status == "pass" and result.detail.startswith(words), result


_TAKEN = {"glibc.malloc.arena_max": [0, 1, 2**64 - 1], "glibc.malloc.check": [0, 0, 3],
          "glibc.malloc.mmap_threshold": [0, 0, 2**64 - 1], "glibc.malloc.trim_threshold": [0, 0, 2**64 - 1],
          "glibc.malloc.perturb": [0, 0, 255]}
"""What glibc's loader lists (``ld.so --list-tunables``) for an environment that sets no heap variable."""


@pytest.mark.parametrize(("env", "taken", "lines"), [
    ({"MALLOC_ARENA_MAX": "abc"}, {}, ["MALLOC_ARENA_MAX='abc' is not a whole number, so glibc ignores it; valid: "
                                       "a whole number, e.g. MALLOC_ARENA_MAX=4"]),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_treshold=1000:glibc.malloc.arena_max=7"},
     {"glibc.malloc.arena_max": 7},
     ["GLIBC_TUNABLES names glibc.malloc.mmap_treshold, which is no tunable of this glibc, so glibc ignores it; "
      "valid: glibc.malloc.mmap_threshold"]),
    ({"MALLOC_CHECK_": "5"}, {}, ["MALLOC_CHECK_='5' is outside glibc's range 0 to 3, so glibc ignores it; valid: "
                                 "a whole number from 0 to 3"]),
    ({"MALLOC_TRIM_THRESHOLD_": "12k"}, {"glibc.malloc.trim_threshold": 12},
     ["MALLOC_TRIM_THRESHOLD_='12k' is not a whole number, so glibc reads it as 12; valid: a whole number, e.g. "
      "MALLOC_TRIM_THRESHOLD_=12288"]),
    ({"MALLOC_MMAP_THRESHOLD": "1048576"}, {},
     ["MALLOC_MMAP_THRESHOLD is no variable of glibc's, so glibc ignores it; valid: MALLOC_MMAP_THRESHOLD_ "
      "(glibc's names of the heap variables end in an underscore, but MALLOC_ARENA_MAX and MALLOC_ARENA_TEST)"]),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max"}, {},
     ["GLIBC_TUNABLES entry 'glibc.malloc.arena_max' has no value, so glibc ignores it; valid: NAME=VALUE "
      "entries separated by ':', e.g. GLIBC_TUNABLES=glibc.malloc.arena_max=4"]),
    ({"MALLOC_ARENA_MAX": "abc", "GLIBC_TUNABLES": "glibc.malloc.perturb=256"}, {},
     ["MALLOC_ARENA_MAX='abc' is not a whole number, so glibc ignores it; valid: a whole number, e.g. "
      "MALLOC_ARENA_MAX=4",
      "glibc.malloc.perturb='256' in GLIBC_TUNABLES is outside glibc's range 0 to 255, so glibc ignores it; valid: "
      "a whole number from 0 to 255"]),
])
def test_heap_variables_glibc_ignores_are_flagged_one_line_each(env, taken, lines):
    """issue 48: doctor passed MALLOC_ARENA_MAX=abc and a misspelt GLIBC_TUNABLES ("yours, kept for CPU ranks"),
    which glibc ignores (or misreads) without a word. Each is a warning of its own, saying what is wrong and what is
    valid; the verdict is glibc's own where its loader lists what it took (``taken``)."""
    from multigpu.doctor.checks import check_cpu_heap

    tunables = {name: [taken.get(name, v[0]), v[1], v[2]] for name, v in _TAKEN.items()}
    results = check_cpu_heap(dataclasses.replace(HEALTHY_GPU, glibc="2.36", env=env, malloc_tunables=tunables))
    assert isinstance(results, list), results
    assert [(r.name, r.status, r.detail) for r in results] == [("CPU ranks' heap", "warn", line) for line in lines]
    assert all("\n" not in r.detail and r.hint for r in results)
    flat = run_checks(dataclasses.replace(HEALTHY_GPU, glibc="2.36", env=env, malloc_tunables=tunables))
    assert [r.detail for r in flat if r.name == "CPU ranks' heap"] == lines


@pytest.mark.parametrize("env", [{"MALLOC_ARENA_MAX": "4"}, {"MALLOC_ARENA_MAX": "0x10"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.check=3"},
                                 {"GLIBC_TUNABLES": "glibc.rtld.nns=8"}])
def test_heap_variables_glibc_takes_are_not_flagged(env):
    from multigpu.doctor.checks import check_cpu_heap

    result = check_cpu_heap(dataclasses.replace(HEALTHY_GPU, glibc="2.36", env=env))  # without the loader's list
    assert not isinstance(result, list) and result.status == "pass", result


def test_the_heap_verdict_agrees_with_what_glibcs_loader_takes():
    """The same variables through this machine's glibc (``ld.so --list-tunables``, as the doctor gathers it): the
    values glibc takes as given pass, those it ignores or misreads are flagged."""
    from multigpu.doctor.checks import check_cpu_heap
    from multigpu.launch import heap

    assert heap.glibc_version() is not None, "this test needs glibc (Linux)"
    cases = {"MALLOC_ARENA_MAX": ("4", "abc"), "MALLOC_CHECK_": ("3", "5"), "MALLOC_TRIM_THRESHOLD_": ("4096", "12k"),
             "GLIBC_TUNABLES": ("glibc.malloc.arena_max=7", "glibc.malloc.mmap_treshold=1000")}
    for name, (good, bad) in cases.items():
        for value, flagged in ((good, False), (bad, True)):
            taken = heap.malloc_tunables({name: value})
            assert taken is not None and "glibc.malloc.arena_max" in taken, taken
            result = check_cpu_heap(dataclasses.replace(HEALTHY_GPU, glibc=heap.glibc_version(), env={name: value},
                                                        malloc_tunables=taken))
            assert isinstance(result, list) is flagged, (name, value, result)
