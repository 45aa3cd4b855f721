"""On a real GPU, what the fake-CUDA tier proves by construction (tests/fakecuda/test_train_cuda.py and
test_launcher_cuda.py): the launcher's checks create no CUDA context, a rank's RNG state goes back into its
own GPU, and a process given one GPU (SLURM's ``--gpus-per-task=1``) computes on ``cuda:0`` whatever its
local rank."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from multigpu.testing import requires_gpus
from tests.conftest import ROOT

pytestmark = pytest.mark.gpu

_CHECK = """
import torch
from multigpu.jobs.command import load_workload_config, prepare
from multigpu.jobs.registry import get_workload
from multigpu.launch.config import LaunchConfig
from multigpu.runtime.context import RunContext

for name, overrides in [("train", ["precision=bf16"]), ("train", ["strategy=fsdp", "precision=bf16"]),
                        ("sim", []), ("infer", []), ("rl", [])]:
    workload = get_workload(name)
    prepare(workload, load_workload_config(workload, None, overrides), LaunchConfig(gpus="all"), RunContext())
print("initialized" if torch.cuda.is_initialized() else "no context")
"""

_PLACE = """
from multigpu.runtime.context import RunContext
from multigpu.runtime.device import DeviceFacts, select_device
from multigpu.runtime.env import read_placement
import os
print(select_device("auto", read_placement(os.environ).local_rank, DeviceFacts.probe(RunContext())))
"""


def _python(code: str, **env: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **env})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


@requires_gpus(1)
def test_every_workloads_launcher_check_leaves_cuda_uninitialized():
    assert _python(_CHECK) == "no context"


@requires_gpus(1)
def test_a_slurm_task_with_one_gpu_uses_cuda_0():
    last = str(torch.cuda.device_count() - 1)  # the task's GPU need not be the node's first
    slurm = {"SLURM_PROCID": "7", "SLURM_LOCALID": "7", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "8",
             "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "1", "CUDA_VISIBLE_DEVICES": last}
    assert _python(_PLACE, **slurm) == "cuda:0"


@requires_gpus(1)
def test_rng_state_goes_back_into_the_current_gpu():
    from multigpu.runtime.rng import capture_rng, restore_rng

    torch.cuda.set_device(torch.cuda.device_count() - 1)
    torch.rand(1, device="cuda")  # CUDA in use, as in a rank
    state = capture_rng()
    assert isinstance(state["cuda"], torch.Tensor)  # this GPU's state only, not a list of every visible GPU's
    first = torch.rand(4, device="cuda")
    restore_rng(state)
    assert torch.equal(torch.rand(4, device="cuda"), first)
