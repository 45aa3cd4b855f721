"""The fake-CUDA harness itself: it must raise where CUDA raises and run what CUDA runs.

If these fail, every fake-CUDA test above them proves nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from multigpu.testing.fakecuda import fake_cuda, fake_group, is_fake

MIXED = "same device|device between|two different devices"
"""A mix of devices refused: torch's words on a GPU, and the fake mode's on a CPU build and on a CUDA build."""


def test_mixed_devices_raise_as_on_cuda_and_legal_moves_run():
    outside = torch.nn.Linear(4, 4)
    with fake_cuda(devices=8) as cuda:
        assert torch.cuda.is_available() and torch.cuda.device_count() == 8
        with pytest.raises(RuntimeError, match=MIXED):
            torch.zeros(5).index_add(0, torch.tensor([0, 1]), torch.ones(2, device="cuda"))
        with pytest.raises(RuntimeError, match=MIXED):
            torch.nn.Linear(4, 4)(torch.randn(2, 4, device="cuda"))
        moved = outside.to("cuda")
        assert moved.weight.device == torch.device("cuda:0") and is_fake(moved.weight)
        assert moved(torch.randn(2, 4, device="cuda")).device.type == "cuda"
        inner = torch.nn.Linear(3, 3)
        torch.cuda.set_device(5)
        assert inner.to("cuda").weight.device == torch.device("cuda:5") and cuda.set_device_calls == [5]
        x = torch.zeros(5, device="cuda:5")
        assert x[torch.tensor([1, 2])].shape == (2,) and x[1:3].device == x.device  # a CPU index is legal
        with pytest.raises(RuntimeError, match="boolean mask"):
            x[x > 0]
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.cuda.set_device(8)
        with pytest.raises(RuntimeError, match="backward on fake CUDA"):
            moved(torch.randn(2, 4, device=moved.weight.device)).sum().backward()
        assert torch.ones(3, device="cuda").cpu().device.type == "cpu"


def test_fake_group_runs_collectives_at_any_world_size():
    with fake_group(rank=63, world_size=1024), fake_cuda():
        assert dist.get_world_size() == 1024 and dist.get_rank() == 63
        x = torch.zeros(5, device="cuda")
        dist.all_reduce(x)
        out = torch.empty(5 * 1024, device="cuda")
        dist.all_gather_into_tensor(out, x)
        assert out.device.type == "cuda"
    assert not dist.is_initialized()


def test_rng_state_of_faked_devices_is_per_device():
    with fake_cuda(devices=2, tensors=False):
        assert len(torch.cuda.get_rng_state_all()) == 2
        with pytest.raises(IndexError, match="not visible"):
            torch.cuda.set_rng_state_all([torch.zeros(16, dtype=torch.uint8)] * 3)
