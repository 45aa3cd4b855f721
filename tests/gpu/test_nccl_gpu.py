"""NCCL on this machine: a process group and its collectives at world size 1, and across 2 GPUs where there are 2.

multigpu never creates a process group for one process (every collective is the
identity), so world size 1 checks torch's NCCL directly on a file store: it is
what every GPU rank of a larger job relies on.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import multigpu as mg
from multigpu.testing import requires_backend, requires_gpus, run_on_ranks

pytestmark = pytest.mark.gpu


@requires_gpus(1)
@requires_backend("nccl")
def test_nccl_group_and_collectives_at_world_size_one(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    env = mg.init(backend="cuda")
    assert env.device == torch.device("cuda", 0) and env.backend == "none" and env.world_size == 1
    t = torch.arange(4.0, device=env.device)
    assert mg.all_reduce(t) is t and mg.gather(t, dst=0) is t  # one process: identities
    mg.shutdown()

    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=60), device_id=dev)
    try:
        assert dist.get_backend() == "nccl"
        x = torch.arange(8, dtype=torch.float32, device=dev)
        dist.all_reduce(x)
        out = torch.empty(8, device=dev)
        dist.all_gather_into_tensor(out, x)
        half = torch.empty(8, device=dev)
        dist.reduce_scatter_tensor(half, x)
        dist.broadcast(x, src=0)
        dist.barrier(device_ids=[0])
        torch.cuda.synchronize()
        expected = torch.arange(8, dtype=torch.float32, device=dev)
        assert torch.equal(x, expected) and torch.equal(out, expected) and torch.equal(half, expected)
    finally:
        dist.destroy_process_group()


def _nccl_body() -> dict:
    env = mg.get_env()
    t = torch.full((3,), float(env.rank + 1), device=env.device)
    mg.all_reduce(t, "sum")
    m = torch.tensor([float(env.rank)], device=env.device)
    mg.all_reduce(m, "max")
    part = torch.full((env.rank + 2, 2), float(env.rank), device=env.device)  # uneven dim 0
    gathered = mg.gather(part, dst=None)
    b = torch.full((2,), 7.0 if env.rank == 0 else -1.0, device=env.device)
    mg.broadcast(b, src=0)
    mg.barrier()
    return {"device": str(env.device), "backend": env.backend, "sum": t.tolist(), "max": m.item(),
            "gathered": gathered.cpu().tolist(), "broadcast": b.tolist(),
            "object": mg.broadcast_object({"from": env.rank}, src=1)}


@requires_gpus(2)
@requires_backend("nccl")
def test_nccl_collectives_across_two_gpus():
    ranks = run_on_ranks(_nccl_body, 2, backend="cuda", env={"CUDA_VISIBLE_DEVICES": "0,1"}, timeout_s=120)
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:1"] and {r["backend"] for r in ranks} == {"nccl"}
    for r in ranks:
        assert r["sum"] == [3.0] * 3 and r["max"] == 1.0 and r["broadcast"] == [7.0, 7.0]
        assert r["gathered"] == [[0.0, 0.0]] * 2 + [[1.0, 1.0]] * 3 and r["object"] == {"from": 1}
