"""doctor on GPUs: the bandwidth test's size and timing, thresholds by topology, and one line each for
P2P, NVLink and InfiniBand/GPUDirect where found. Pure checks over made-up facts, as the doctor's other checks."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import torch

from multigpu.doctor import Facts, run_checks
from multigpu.doctor.checks import check_bandwidth, check_infiniband, check_nvlink, check_p2p
from tests.unit.test_doctor_checks import HEALTHY_GPU

GB = 1e9


def _bw(busbw: float) -> dict:
    return {"world_size": 8, "backend": "nccl", "size_bytes": 256 * 2**20, "seconds": 0.01,
            "algbw_gbps": busbw * 8 / 14, "busbw_gbps": busbw, "timing": "cuda events"}


NVLINK_NODE = dataclasses.replace(
    HEALTHY_GPU, gpus=("NVIDIA H100 80GB HBM3",) * 8, nvml_gpus=("NVIDIA H100 80GB HBM3",) * 8,
    nvlink=(18,) * 8, p2p=tuple((i, j, True) for i in range(8) for j in range(8) if i < j),
    infiniband=(("mlx5_0", "ACTIVE"), ("mlx5_1", "ACTIVE")), gpudirect_rdma=True, bandwidth=_bw(380.0))


def test_an_nvlink_node_passes_with_a_line_for_each_path():
    results = {r.name: r for r in run_checks(NVLINK_NODE)}
    assert all(r.status == "pass" for r in results.values()), [r for r in results.values() if r.status != "pass"]
    assert "active links GPU 0: 18" in results["NVLink"].detail
    assert "every pair of the 8 GPUs (28 pairs)" in results["GPU peer-to-peer"].detail
    assert "GPUDirect RDMA on" in results["InfiniBand / GPUDirect"].detail
    assert "at least 40 GB/s expected over NVLink" in results["all-reduce bandwidth"].detail


def test_socket_speed_on_nvlink_gpus_is_a_warning():
    """12 GB/s passed the old 1 GB/s bar; on NVLink it means NCCL is not using it."""
    slow = check_bandwidth(dataclasses.replace(NVLINK_NODE, bandwidth=_bw(12.0)))
    assert slow.status == "warn" and "slow for NVLink" in slow.detail and "NCCL_P2P_DISABLE" in slow.hint


def test_thresholds_follow_the_topology():
    pcie = dataclasses.replace(NVLINK_NODE, nvlink=(0,) * 8)
    assert check_bandwidth(dataclasses.replace(pcie, bandwidth=_bw(12.0))).status == "pass"  # PCIe P2P speed
    assert check_bandwidth(dataclasses.replace(pcie, bandwidth=_bw(5.0))).status == "warn"
    no_p2p = dataclasses.replace(pcie, p2p=((0, 1, False),))
    assert check_bandwidth(dataclasses.replace(no_p2p, bandwidth=_bw(5.0))).status == "pass"  # through host memory
    sockets = check_bandwidth(dataclasses.replace(no_p2p, bandwidth=_bw(2.0)))  # passed the old bar too
    assert sockets.status == "warn" and "host shared memory" in sockets.detail
    gloo = dict(_bw(0.5), backend="gloo")
    assert check_bandwidth(dataclasses.replace(no_p2p, bandwidth=gloo)).status == "pass"  # CPU ranks: no GPU bar


def test_broken_paths_are_named():
    one_down = check_nvlink(dataclasses.replace(NVLINK_NODE, nvlink=(18, 18, 0, 18, 18, 18, 18, 18)))
    assert one_down.status == "warn" and "GPU(s) 2 have none" in one_down.detail
    no_pair = check_p2p(dataclasses.replace(NVLINK_NODE, p2p=((0, 1, True), (0, 2, False), (1, 2, False))))
    assert no_pair.status == "warn" and "0<->2, 1<->2" in no_pair.detail
    ib_down = check_infiniband(dataclasses.replace(NVLINK_NODE, infiniband=(("mlx5_0", "DOWN"),)))
    assert ib_down.status == "warn" and "no adapter is ACTIVE" in ib_down.detail
    no_rdma = check_infiniband(dataclasses.replace(NVLINK_NODE, gpudirect_rdma=False))
    assert no_rdma.status == "warn" and "nvidia_peermem" in no_rdma.hint


def test_no_line_where_there_is_nothing_to_find():
    names = {r.name for r in run_checks(Facts())}
    assert not names & {"NVLink", "GPU peer-to-peer", "InfiniBand / GPUDirect"}


def test_the_gpu_test_moves_256_mib_and_the_cpu_test_16(tmp_path):
    from multigpu.doctor import bandwidth

    seen = []

    def launch(cfg, target, args, module):
        seen.append((cfg.cpu, int(args[1]), int(args[2])))
        with open(args[0], "w") as fh:
            json.dump({"ok": True}, fh)

    with mock.patch("multigpu.launch.launch", launch):
        bandwidth.measure(gpus=8)
        bandwidth.measure(gpus=0)
    assert seen == [(False, 256, 20), (True, 16, 5)]


def test_gpu_all_reduces_are_timed_by_cuda_events_not_the_host_clock():
    """The host returns at once from each queued all-reduce; the events say 10 ms each."""
    from multigpu.doctor._bandwidth_worker import seconds_per_all_reduce

    clock = {"gpu": 0.0}

    class Event:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            self.at = clock["gpu"]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return (other.at - self.at) * 1000

    def all_reduce(buf):
        clock["gpu"] += 0.010

    with mock.patch("torch.cuda.Event", Event), mock.patch("torch.cuda.current_stream", lambda d=None: None), \
            mock.patch("torch.distributed.all_reduce", all_reduce):
        seconds = seconds_per_all_reduce(torch.ones(1), 20, torch.device("cuda", 0))
    assert abs(seconds - 0.010) < 1e-9
