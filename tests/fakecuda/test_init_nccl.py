"""``mg.init``'s NCCL branch, and the NCCL job's gloo groups, on a CPU-only machine.

:func:`~multigpu.testing.fakecuda.fake_init` lets ``init_process_group`` and ``new_group`` run as the job calls
them (the backend string, ``device_id``, ``env://``), answered by the ``fake`` backend; :func:`fake_cuda` gives
rank 3 its GPU. What waits for a GPU: NCCL itself (the communicator, its kernels), which run_all.sh's smoke step
checks on one.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import multigpu as mg
from multigpu.runtime import context, group
from multigpu.runtime.context import RunContext
from multigpu.testing.fakecuda import fake_cuda, fake_init, is_fake


@pytest.fixture
def rank3_of_8(monkeypatch):
    """This process as rank 3 of 8 on one node, started by torchrun (its variables)."""
    for name, value in {"RANK": 3, "LOCAL_RANK": 3, "WORLD_SIZE": 8, "LOCAL_WORLD_SIZE": 8,
                        "MASTER_ADDR": "localhost", "MASTER_PORT": 1, "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(name, str(value))
    context.set_current(RunContext(timeout_s=42))
    yield
    mg.shutdown(barrier=False)
    context.set_current(RunContext())


def test_init_on_gpus_joins_nccl_bound_to_its_gpu_with_a_gloo_group_beside(rank3_of_8, monkeypatch):
    """Rank 3 of 8 with a GPU each: its device is cuda:3 (set current before the group exists), the group is
    ``cpu:gloo,cuda:nccl`` bound to cuda:3 (``device_id``: NCCL's communicator is made eagerly there), a warm-up
    all-reduce on the GPU makes a bad placement fail in init, and a gloo group of every rank sits beside it
    for host-side collectives (shapes, monitored barriers); inference's point-to-point exchange group is gloo too."""
    warm = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: warm.append(t.device) or real_all_reduce(t, *a, **k))
    with fake_cuda(devices=8) as cuda, fake_init(3, 8) as calls:
        env = mg.init(seed=0)
        assert (env.rank, env.world_size, env.device, env.backend) == (3, 8, torch.device("cuda", 3), "nccl")
        assert cuda.set_device_calls[0] == 3
        name, init = calls[0]
        assert name == "init_process_group" and init["backend"] == "cpu:gloo,cuda:nccl"
        assert init["device_id"] == torch.device("cuda", 3) and init["timeout"] == timedelta(seconds=42)
        assert init["init_method"] == "env://" and (init["rank"], init["world_size"]) == (3, 8)
        assert dist.group.WORLD.bound_device_id == torch.device("cuda", 3)
        assert warm == [torch.device("cuda", 3)]  # the warm-up, on this rank's GPU
        assert calls[1] == ("new_group", {"ranks": None, "timeout": timedelta(seconds=42), "backend": "gloo"})
        assert group.host_group() is group.monitor_group() is not None
        exchange = group.exchange_group()
        assert calls[2][0] == "new_group" and calls[2][1]["backend"] == "gloo" and exchange is not None
        x = torch.ones(4, device="cuda")
        mg.all_reduce(x, check_shapes=False)  # over NCCL (the fake group's shapes would be garbage to check)
        assert x.device == torch.device("cuda", 3) and is_fake(x)


def test_device_before_init_is_the_ranks_gpu_made_current_as_set_device_did(rank3_of_8):
    """A torchrun script that keeps its own ``init_process_group`` replaces ``torch.cuda.set_device(local_rank)``
    with ``mg.device()`` (docs/migration/nanogpt.md, torchrun.md): that GPU must then be the current CUDA device
    (``.cuda()``, NCCL and streams use it), and ``str()`` of it is the string nanoGPT tests ``'cuda' in``."""
    with fake_cuda(devices=8) as cuda:
        dev = mg.device()
        assert dev == torch.device("cuda", 3) and str(dev) == "cuda:3"
        assert cuda.set_device_calls == [3]
