"""Staging a checkpoint from the GPU, on fake CUDA: into pinned host buffers, kept from one save to the next,
and read only after the copies have landed.

A background save (``checkpoint_mode=async``) copies the state to the host between two steps and lets a thread
write it while the next steps change the GPU tensors in place. The copies are queued without blocking (into
pinned memory, so they overlap) and the run does not wait for them: the next step's kernels follow them on the
same stream. The writer must not read a buffer before its copy has landed (it waits for the event staging
recorded), which the fake catches as a GPU would give a torn checkpoint
(:class:`~multigpu.testing.fakecuda.StreamOrderError`).
"""

from __future__ import annotations

import pytest
import torch

from multigpu.checkpoint.staging import Stager, landed
from multigpu.testing.fakecuda import StreamOrderError, fake_cuda


def test_gpu_state_is_staged_into_pinned_host_buffers_kept_between_saves_and_read_after_its_copies():
    with fake_cuda(devices=2) as cuda:
        torch.cuda.set_device(1)
        model = {"w": torch.zeros(4, 3, device="cuda:1"), "b": torch.zeros(3, device="cuda:1")}
        stager = Stager()
        staged, ready = stager.stage({"model": model, "step": 3, "groups": [{"lr": 0.1}]}, wait=False)
        w = staged["model"]["w"]
        assert w.device.type == "cpu" and w.is_pinned() and staged["model"]["b"].is_pinned()
        assert staged["step"] == 3 and staged["groups"] == [{"lr": 0.1}]
        assert len(ready) == 1  # the run did not wait: one event on cuda:1's stream, after the copies
        with pytest.raises(StreamOrderError):  # the buffers used again before anyone waited for the copies
            stager.stage({"model": model, "step": 4, "groups": [{"lr": 0.1}]})
        landed(ready)  # what the writer thread does first (and the next save waits for the writer)
        pinned = cuda.pinned
        again, ready = stager.stage({"model": model, "step": 4, "groups": [{"lr": 0.1}]})  # wait=True: landed
        assert again["model"]["w"] is w and cuda.pinned == pinned and ready == []  # the same buffers, pinned once
        (w * 2).sum()
