"""Reading rank coordinates (torchrun, SLURM, alone), choosing devices, backends and threads."""

from __future__ import annotations

import pytest
import torch

from multigpu.errors import ConfigError, DeviceError
from multigpu.runtime.device import DeviceFacts, choose_backend, select_device
from multigpu.runtime.env import Placement, expand_slurm_nodelist, read_placement, slurm_master_port
from multigpu.runtime.group import thread_budget


def test_alone_is_world_size_one():
    assert read_placement({}) == Placement()


def test_torchrun_variables():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
           "MASTER_ADDR": "n0", "MASTER_PORT": "29400"}
    p = read_placement(env)
    assert (p.rank, p.local_rank, p.world_size, p.local_world_size, p.node_rank) == (3, 1, 4, 2, 1)
    assert (p.master_addr, p.master_port, p.source) == ("n0", 29400, "torchrun")


def test_slurm_variables_and_nodelist():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "2",
           "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "123456"}
    p = read_placement(env)
    assert (p.rank, p.local_rank, p.world_size, p.local_world_size, p.node_rank) == (5, 1, 8, 2, 2)
    assert p.master_addr == "gpu07" and p.master_port == slurm_master_port("123456") and p.source == "slurm"
    assert expand_slurm_nodelist("a[1-3,7],b01,c[08-09]") == ["a1", "a2", "a3", "a7", "b01", "c08", "c09"]
    assert read_placement({**env, "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS_PER_NODE": ""}).local_world_size == 4


@pytest.mark.parametrize("env,match", [
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK=.x. must be a whole number"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, "outside"),
])
def test_bad_rank_variables_are_clear(env, match):
    with pytest.raises(ConfigError, match=match):
        read_placement(env)


def test_device_rules():
    four = DeviceFacts(cuda_count=4)
    assert select_device("auto", 2, four) == torch.device("cuda", 2)
    assert select_device("auto", 0, DeviceFacts()) == torch.device("cpu")
    assert select_device("auto", 0, DeviceFacts(mps_available=True)) == torch.device("mps")
    assert select_device("cpu", 0, four) == torch.device("cpu")
    assert select_device("cuda", 3, DeviceFacts(cuda_count=1, isolated=True)) == torch.device("cuda", 0)
    assert select_device("auto", 5, DeviceFacts(cuda_count=4, allow_cpu_ranks=True)) == torch.device("cpu")
    with pytest.raises(DeviceError, match="local_rank 5 has no GPU.*sees 4 CUDA device.*--allow-cpu-ranks"):
        select_device("auto", 5, four)
    # srun --gpus-per-task=1: every task sees its own one GPU while SLURM_LOCALID runs 0..7
    assert [select_device("auto", r, DeviceFacts(cuda_count=1)) for r in range(8)] == [torch.device("cuda", 0)] * 8
    assert select_device("cuda", 7, DeviceFacts(cuda_count=1)) == torch.device("cuda", 0)
    # ranks asked to share the GPUs (collectives over gloo): round-robin; a CPU rank of a hybrid job sees no GPU
    assert select_device("auto", 5, DeviceFacts(cuda_count=4, share_gpus=True)) == torch.device("cuda", 1)
    assert select_device("cuda", 1, DeviceFacts(allow_cpu_ranks=True, hybrid=True)) == torch.device("cpu")
    with pytest.raises(DeviceError, match="no CUDA device"):
        select_device("cuda", 0, DeviceFacts())
    with pytest.raises(ConfigError, match="auto, cuda, mps, cpu"):
        select_device("tpu", 0, four)


def test_backend_rules():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert choose_backend(cuda, 1, DeviceFacts()) == "none"
    assert choose_backend(cuda, 2, DeviceFacts()) == "nccl"
    assert choose_backend(cuda, 2, DeviceFacts(hybrid=True)) == "gloo"  # some rank is on the CPU
    assert choose_backend(cpu, 2, DeviceFacts()) == "gloo"
    assert choose_backend(cuda, 2, DeviceFacts(), override="gloo") == "gloo"


def test_thread_budget(monkeypatch):
    monkeypatch.setattr("multigpu.runtime.group.cpu_count", lambda: 8)
    assert thread_budget(2, env={}) == 4
    assert thread_budget(16, env={}) == 1
    assert thread_budget(2, env={"OMP_NUM_THREADS": "3"}) == 3
    assert thread_budget(2, threads=5, env={"OMP_NUM_THREADS": "3"}) == 5
    with pytest.raises(ConfigError):
        thread_budget(1, threads=0, env={})


def test_rank_variables_without_a_launcher_are_told_apart():
    """torchrun, multigpu launch and srun mark their rank variables; leftovers in the shell do not. (The test harness
    brings its own rendezvous, ``mg.init(init_method=...)``: no variable of its own reaches production.)"""
    from multigpu.runtime.env import found_variables, launcher_variable

    leftover = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "h", "PATH": "/bin"}
    assert launcher_variable(leftover) is None
    assert found_variables("torchrun", leftover) == "RANK=0 WORLD_SIZE=2 MASTER_ADDR=h"
    assert found_variables("slurm", {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}) == "SLURM_PROCID=1 SLURM_NTASKS=2"
    for marker in ("TORCHELASTIC_RUN_ID", "MULTIGPU_RUN_FILE", "SLURM_STEP_ID"):
        assert launcher_variable({**leftover, marker: "x"}) == marker
