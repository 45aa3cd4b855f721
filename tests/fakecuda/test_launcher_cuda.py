"""The launcher never initializes CUDA: every workload's check and launch on a faked 8-GPU host.

A CUDA context in the launcher holds 0.5-1 GiB on GPU 0 for the whole job, beside rank 0's own, and
fails outright on GPUs in exclusive-process mode. Here every ``torch.cuda`` entry point that would
create one, and any tensor placed on CUDA, raises (:func:`~multigpu.testing.fakecuda.forbid_cuda_init`)
while the real command line plans a host of 8 GPUs (the injected ``HostFacts`` seam, as
``tests/scripts/fake_gpu_cli.py`` does) and runs everything up to torch's ``elastic_launch`` (mocked).
"""

from __future__ import annotations

from unittest import mock

import pytest

from multigpu.cli import main
from multigpu.launch.devices import HostFacts
from multigpu.testing.fakecuda import CudaInitialized, forbid_cuda_init


@pytest.fixture
def eight_gpus(monkeypatch):
    """``eight_gpus(capability)``: the launcher plans 8 GPUs of that compute capability (None: no NVML)."""
    def install(capability: tuple[int, int] | None = (9, 0)) -> None:
        facts = HostFacts(gpu_count=8, cores=2, gpu_capabilities=(capability,) * 8 if capability else None)
        monkeypatch.setattr(HostFacts, "probe", classmethod(lambda cls: facts))
    return install


@pytest.fixture
def seam():
    with mock.patch("multigpu.launch.agent._elastic_launch") as fake:
        yield fake


@pytest.mark.parametrize("argv", [
    ["train", "--precision", "bf16"],
    ["train", "--precision", "bf16", "--strategy", "fsdp", "fsdp_cpu_offload=true"],
    ["train", "--dtype", "bf16", "--precision", "fp32"],
    ["sim"],
    ["infer"],
    ["rl"],
], ids=["train-bf16", "train-fsdp-offload", "train-bf16-weights", "sim", "infer", "rl"])
def test_no_workload_initializes_cuda_in_the_launcher(argv, tmp_path, eight_gpus, seam):
    eight_gpus()
    with forbid_cuda_init(devices=8):
        assert main([argv[0], "--run-dir", str(tmp_path / "run"), "--gpus", "all", *argv[1:]]) == 0
    (config, _, _), _ = seam.call_args
    assert config.nproc_per_node == 8


def test_bf16_is_decided_from_nvml_compute_capability(tmp_path, eight_gpus, seam, capsys):
    eight_gpus((7, 0))  # V100: no bf16
    with forbid_cuda_init(devices=8):
        assert main(["train", "--run-dir", str(tmp_path / "v100"), "--gpus", "all", "--precision", "bf16"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: bf16 is not supported") and "compute capability 8.0+" in err and "\n" not in err
    assert not seam.called and not (tmp_path / "v100").exists()
    eight_gpus(None)  # no nvidia-ml-py: said, and left to each rank's own check at start
    with forbid_cuda_init(devices=8):
        assert main(["train", "--run-dir", str(tmp_path / "nonvml"), "--gpus", "all", "--precision", "bf16"]) == 0
    assert "checked by each rank at start" in capsys.readouterr().err and seam.called


def test_the_guard_itself_catches_a_cuda_context():
    import torch

    with forbid_cuda_init(devices=8):
        assert torch.cuda.is_available() and torch.cuda.device_count() == 8
        for touch in (lambda: torch.ones(2, device="cuda"), lambda: torch.zeros(2).to("cuda:1"),
                      lambda: torch.cuda.is_bf16_supported(), lambda: torch.cuda.get_device_capability(0),
                      lambda: torch.nn.Linear(2, 2).cuda()):
            with pytest.raises(CudaInitialized):
                touch()


def test_compute_capability_of_the_selected_gpus_through_nvml(monkeypatch):
    import types

    from multigpu.launch.config import LaunchConfig
    from multigpu.launch.devices import _gpu_capabilities, plan_devices

    boards = {"0": (7, 5), "1": (8, 0), "GPU-9f": (9, 0)}
    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlDeviceGetHandleByIndex=lambda i: str(i), nvmlDeviceGetHandleByUUID=lambda u: u,
                                 nvmlDeviceGetCudaComputeCapability=lambda h: boards[h])
    monkeypatch.setitem(__import__("sys").modules, "pynvml", nvml)
    assert _gpu_capabilities(["1", "GPU-9f"]) == ((8, 0), (9, 0))  # physical indices or UUIDs
    assert _gpu_capabilities(["5"]) is None  # NVML does not know it: unknown, never a guess
    facts = HostFacts(gpu_count=3, visible="0,1,GPU-9f", gpu_capabilities=((7, 5), (8, 0), (9, 0)))
    assert plan_devices(LaunchConfig(gpus="1,2"), facts, inherited={}).gpu_capability == (8, 0)  # the lowest chosen
    assert plan_devices(LaunchConfig(), facts, inherited={}).gpu_capability == (7, 5)
    assert plan_devices(LaunchConfig(), HostFacts(gpu_count=3), inherited={}).gpu_capability is None


def test_the_real_host_probe_needs_no_cuda_context():
    """What the launcher asks torch about the host (the count of GPUs) needs the driver, never a context."""
    with forbid_cuda_init(devices=8):
        facts = HostFacts.probe()
    assert facts.gpu_count == 8 and len(facts.physical_ids()) == 8


def test_bench_names_the_gpus_without_a_cuda_context(monkeypatch):
    """``multigpu bench`` records the host's GPUs in bench.json from NVML (nvidia-ml-py), not from
    ``torch.cuda.get_device_name``, which creates a CUDA context in the launcher before the workers start.
    Without nvidia-ml-py the names are unknown, said so; the count is still right. Before: CudaInitialized."""
    import sys
    import types

    from multigpu.bench.runner import _host

    nvml = types.SimpleNamespace(nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 8,
                                 nvmlDeviceGetHandleByIndex=lambda i: i,
                                 nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3" if h < 4 else "NVIDIA H200")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,4")
    with forbid_cuda_init(devices=2):
        assert _host()["gpus"] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with forbid_cuda_init(devices=2):
        assert _host()["gpus"] == ["unknown (pip install nvidia-ml-py to name it)"] * 2


def test_gpu_memory_is_the_smallest_of_the_selected_gpus_not_of_every_gpu_nvml_sees(monkeypatch):
    """NVML numbers every GPU of the node; the job uses the visible ones (``CUDA_VISIBLE_DEVICES``) and of those the
    selected ones (``--gpus``). A workload's GPU budget (``memory_per_rank("cuda")``) is the smallest of the GPUs
    its ranks run on. Before: the minimum over every GPU NVML sees, so a 16 GiB board elsewhere on the node made a
    job on two 80 GiB boards plan for 16 GiB."""
    import sys
    import types

    from multigpu.launch.config import LaunchConfig
    from multigpu.launch.devices import plan_devices

    gib = 1 << 30
    boards = {0: 16 * gib, 1: 80 * gib, 2: 141 * gib, 3: 40 * gib}
    uuids = {"GPU-aa": 2}
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: len(boards),
        nvmlDeviceGetHandleByIndex=lambda i: int(i), nvmlDeviceGetHandleByUUID=lambda u: uuids[u],
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=boards[h]),
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0))
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-aa,3")  # physical 1 and 3 by index, 2 by its UUID
    with forbid_cuda_init(devices=3):
        facts = HostFacts.probe()
    assert facts.gpu_memory_bytes == 40 * gib  # the smallest visible one, not GPU 0's 16 GiB
    assert facts.gpu_memories == (80 * gib, 141 * gib, 40 * gib)  # each visible GPU, in visible order
    plan = plan_devices(LaunchConfig(gpus="0,1"), facts, inherited={})  # visible 0 and 1: physical 1 and GPU-aa
    assert plan.gpu_ids == ["1", "GPU-aa"] and plan.memory_per_rank("cuda") == 80 * gib
    assert plan_devices(LaunchConfig(gpus="1,"), facts, inherited={}).memory_per_rank("cuda") == 141 * gib  # GPU 1
    assert plan_devices(LaunchConfig(), facts, inherited={}).memory_per_rank("cuda") == 40 * gib
    # NVML does not know one of them: unknown, never a guess from the others
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-zz")
    with forbid_cuda_init(devices=2):
        unknown = HostFacts.probe()
    assert unknown.gpu_memories is None and unknown.gpu_memory_bytes is None
    # facts given without the per-GPU figures (a test's, a dry run's) keep their one figure
    assert plan_devices(LaunchConfig(), HostFacts(gpu_count=2, gpu_memory_bytes=8 * gib),
                        inherited={}).memory_per_rank("cuda") == 8 * gib
