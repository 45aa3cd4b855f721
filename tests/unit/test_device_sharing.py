"""More ranks than GPUs: NCCL's one-rank-per-GPU rule as a clear error, or deliberate sharing over gloo.

These pin the contract that keeps a job from reaching NCCL's own crash
("Duplicate GPU detected"): the launcher refuses the placement with the valid
choices, or, with ``--share-gpus``, pins the ranks to the GPUs round-robin with
collectives on gloo; a rank that still meets NCCL's refusal gets one line of advice.
Pure: fake host facts, no GPU.
"""

from __future__ import annotations

import pytest
import torch

from multigpu.errors import DeviceError
from multigpu.launch._worker import worker_device_env
from multigpu.launch.agent import run_context_for
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import HostFacts, plan_devices
from multigpu.runtime.device import DeviceFacts, choose_backend, select_device
from multigpu.runtime.group import nccl_advice

ONE_GPU = HostFacts(gpu_count=1, visible=None, cores=16)


@pytest.mark.parametrize("cfg", [
    LaunchConfig(nproc_per_node=2),                          # two ranks, one GPU
    LaunchConfig(nproc_per_node=2, isolate_devices=True),    # the same through isolation's device map
    LaunchConfig(nproc_per_node=3, gpus="1"),
])
def test_two_ranks_on_one_gpu_with_nccl_is_one_line_naming_the_choices(cfg):
    with pytest.raises(DeviceError) as err:
        plan_devices(cfg, ONE_GPU, inherited={})
    text = str(err.value)
    assert "\n" not in text and DeviceError.exit_code == 2
    assert "NCCL allows one rank per GPU" in text
    for choice in ("--nproc-per-node 1", "--allow-cpu-ranks", "--cpu", "--share-gpus"):
        assert choice in text


def test_sharing_over_gloo_pins_ranks_round_robin():
    facts = HostFacts(gpu_count=2, visible="4,5", cores=16)
    plan = plan_devices(LaunchConfig(nproc_per_node=3, share_gpus=True), facts, inherited={})
    assert plan.nproc_per_node == 3 and plan.gpu_ids == ["4", "5", "4"]
    assert plan.isolated and plan.shared and plan.env["MULTIGPU_DEVICE_MAP"] == "4,5,4"
    assert "CUDA_VISIBLE_DEVICES" not in plan.env and not plan.hybrid and "share 2 GPU(s)" in plan.note
    ctx = run_context_for(LaunchConfig(nproc_per_node=3, share_gpus=True), plan)
    assert ctx.pg_backend == "gloo" and ctx.isolated  # what every rank reads from the run file
    # each worker then sees its own GPU (all four variables) and computes on cuda:0 over gloo
    assert [worker_device_env(plan.env, r)["CUDA_VISIBLE_DEVICES"] for r in range(3)] == ["4", "5", "4"]
    facts_in_rank = DeviceFacts(cuda_count=1, isolated=True)
    device = select_device("auto", 2, facts_in_rank)
    assert device == torch.device("cuda", 0)
    assert choose_backend(device, 3, facts_in_rank, ctx.pg_backend) == "gloo"


def test_explicit_cpu_ranks_win_over_sharing_and_enough_gpus_change_nothing():
    hybrid = plan_devices(LaunchConfig(nproc_per_node=2, allow_cpu_ranks=True, share_gpus=True), ONE_GPU, inherited={})
    assert hybrid.gpu_ids == ["0"] and hybrid.hybrid and not hybrid.shared
    one_each = plan_devices(LaunchConfig(nproc_per_node=2, share_gpus=True), HostFacts(gpu_count=2), inherited={})
    assert one_each.env["CUDA_VISIBLE_DEVICES"] == "0,1" and not one_each.shared
    assert run_context_for(LaunchConfig(), one_each).pg_backend is None


def test_nccls_duplicate_gpu_refusal_becomes_advice():
    raw = ("NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage (run with NCCL_DEBUG=WARN for details), "
           "NCCL version 2.27.7\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
           "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1e000")
    advice = nccl_advice(raw, 1, torch.device("cuda", 0))
    assert advice is not None and "\n" not in advice
    assert "rank 1 on cuda:0" in advice and "--share-gpus" in advice and "--allow-cpu-ranks" in advice
    assert nccl_advice("NCCL error: unhandled system error", 0, torch.device("cuda", 0)) is None
