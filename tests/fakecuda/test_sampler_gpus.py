"""The sampler samples each rank's own GPU, by UUID: NVML lists GPUs in PCI order and ignores
CUDA_VISIBLE_DEVICES, so NVML's GPU 0 is not rank 0's GPU. Fake NVML and torch facts, one process."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from unittest import mock

import torch

from multigpu.monitor.sampler import Sampler, register_rank

UUIDS = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]  # NVML's order: PCI bus order


def _fake_nvml():
    """Four GPUs; each reports its own utilization (10, 20, 30, 40 %) so the test sees which one was sampled."""
    handles = [SimpleNamespace(index=i, uuid=u) for i, u in enumerate(UUIDS)]
    by_uuid = {h.uuid: h for h in handles}
    return SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=10 * (h.index + 1)),
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=2**30, total=80 * 2**30),
        nvmlDeviceGetPowerUsage=lambda h: 300_000,
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetTemperature=lambda h, sensor: 60,
        nvmlDeviceGetIndex=lambda h: h.index,
        nvmlDeviceGetUUID=lambda h: h.uuid.encode(),
        nvmlDeviceGetHandleByUUID=lambda u: by_uuid[u.decode() if isinstance(u, bytes) else u],
        nvmlShutdown=lambda: None,
    ), handles


def _rank_file(run_dir, rank: int, uuid: str | None) -> None:
    import socket

    (run_dir / "ranks").mkdir(exist_ok=True)
    pid = os.getpid() if rank == 0 else os.getppid()  # two live processes stand for two ranks
    info = {"rank": rank, "local_rank": rank, "node_rank": 0, "pid": pid, "host": socket.gethostname(),
            "gpu_uuid": uuid}
    (run_dir / "ranks" / f"rank{rank}.json").write_text(json.dumps(info))


def test_each_rank_records_its_gpu_uuid_as_torch_sees_it(tmp_path):
    """CUDA_VISIBLE_DEVICES=2,3: rank 1 computes on cuda:1, which torch knows is the node's 4th GPU."""
    props = {0: SimpleNamespace(uuid="cccc"), 1: SimpleNamespace(uuid="dddd")}
    with mock.patch("multigpu.runtime.group.current_device", lambda: torch.device("cuda", 1)), \
            mock.patch("torch.cuda.get_device_properties", lambda i: props[i]):
        path = register_rank(tmp_path)
    assert json.loads(path.read_text())["gpu_uuid"] == "GPU-dddd"


def test_a_cpu_rank_names_no_gpu(tmp_path):
    assert json.loads(register_rank(tmp_path).read_text())["gpu_uuid"] is None


def test_the_sampler_samples_the_ranks_gpus_by_uuid_not_nvml_order(tmp_path):
    """Ranks 0 and 1 on the node's 3rd and 4th GPUs (CUDA_VISIBLE_DEVICES=2,3): sampled are those two, not 0 and 1."""
    _rank_file(tmp_path, 0, "GPU-cccc")
    _rank_file(tmp_path, 1, "GPU-dddd")
    sampler = Sampler(tmp_path, interval_s=1.0, node_rank=0)
    sampler._nvml = _fake_nvml()
    gpus = sampler.sample(first=True)["gpus"]
    assert [(g["index"], g["uuid"], g["ranks"], g["util_percent"]) for g in gpus] == [
        (2, "GPU-cccc", [0], 30), (3, "GPU-dddd", [1], 40)]


def test_ranks_sharing_a_gpu_are_one_sample_and_before_any_rank_says_every_gpu_is_sampled(tmp_path):
    sampler = Sampler(tmp_path, interval_s=1.0, node_rank=0)
    sampler._nvml = _fake_nvml()
    assert [g["util_percent"] for g in sampler.sample(first=True)["gpus"]] == [10, 20, 30, 40]
    _rank_file(tmp_path, 0, "GPU-bbbb")
    _rank_file(tmp_path, 1, "GPU-bbbb")
    gpus = sampler.sample()["gpus"]
    assert [(g["index"], g["ranks"]) for g in gpus] == [(1, [0, 1])]
