"""Training on fake CUDA: device placement, RNG state across GPU counts, SLURM placement, FSDP's placement.

What a CPU-only machine can prove (see :mod:`multigpu.testing.fakecuda`): where every tensor of the
trainer's forward and loss lives on ``cuda``, where the optimizer puts its state, that a checkpoint's
RNG state moves between hosts with different GPU counts, that one GPU per SLURM task is ``cuda:0``,
and that FSDP is never handed a whole model on the GPU. What waits for a GPU: backward (the autograd
engine needs a real CUDA device guard), NCCL itself, and the numbers (loss values, speed).
"""

from __future__ import annotations

import pytest
import torch

import multigpu as mg
from multigpu.runtime.context import RunContext
from multigpu.runtime.device import DeviceFacts, select_device
from multigpu.runtime.env import read_placement
from multigpu.testing.fakecuda import fake_cuda
from multigpu.train.checkpoint import CheckpointManager, restore_rng

SLURM_TASK = {"SLURM_PROCID": "15", "SLURM_LOCALID": "7", "SLURM_NTASKS": "16", "SLURM_NODEID": "1",
              "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}


def _state(value: int) -> torch.Tensor:
    return torch.full((16,), value, dtype=torch.uint8)


def test_slurm_task_with_one_gpu_computes_on_it():
    """``srun --ntasks-per-node=8 --gpus-per-task=1``: each task sees one GPU and SLURM_LOCALID 0..7."""
    placement = read_placement(SLURM_TASK)
    with fake_cuda(devices=1, tensors=False):
        facts = DeviceFacts.probe(RunContext())
        assert (placement.local_rank, facts.cuda_count) == (7, 1)
        assert select_device("auto", placement.local_rank, facts) == torch.device("cuda", 0)
    # two GPUs per task but local rank 7: which one is not ours to guess
    with fake_cuda(devices=2, tensors=False), pytest.raises(mg.DeviceError, match="local_rank 7 has no GPU: this "
                                                                                  "process sees 2 CUDA device"):
        select_device("auto", placement.local_rank, DeviceFacts.probe(RunContext()))


@pytest.mark.parametrize("saved_on,restored_on", [(8, 1), (1, 8)])
def test_checkpoint_rng_state_moves_between_gpu_counts(tmp_path, saved_on, restored_on):
    """Saved by a rank on cuda:5 of 8 visible GPUs and resumed on a one-GPU host (``--isolate-devices``), and the
    reverse: the rank's own GPU's generator comes back on the rank's own GPU, no other GPU's is touched."""
    mg.init(backend="cpu")  # one rank: the manager's gather and broadcast are identities
    manager = CheckpointManager(tmp_path)
    with fake_cuda(devices=saved_on, tensors=False) as cuda:
        torch.cuda.set_device(saved_on - 1)
        cuda.rng_states[saved_on - 1] = _state(42)
        path = manager.save({"step": 1, "model": {}, "optimizer": {}})
    with fake_cuda(devices=restored_on, tensors=False) as cuda:
        torch.cuda.set_device(restored_on - 1)
        restore_rng(manager.load(path)["rng"][0])
        assert list(cuda.rng_states) == [restored_on - 1] and torch.equal(cuda.rng_states[restored_on - 1], _state(42))


def test_rng_state_of_older_checkpoints_with_every_gpu():
    """Checkpoints written before held every visible GPU's state: the rank's own device index is taken."""
    with fake_cuda(devices=1, tensors=False) as cuda:
        restore_rng({"python": __import__("random").getstate(), "torch": torch.get_rng_state(),
                     "cuda": [_state(i) for i in range(8)]})
        assert list(cuda.rng_states) == [0] and torch.equal(cuda.rng_states[0], _state(0))
