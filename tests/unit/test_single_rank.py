"""World size 1 is the same code path: collectives are identities; init is idempotent."""

from __future__ import annotations

import pytest
import torch

import multigpu as mg
from multigpu.errors import NotInitializedError


def test_calls_before_init_say_what_to_do():
    with pytest.raises(NotInitializedError, match=r"barrier\(\) was called before multigpu.init\(\)"):
        mg.barrier()
    with pytest.raises(NotInitializedError, match="multigpu launch"):
        mg.gather([1])


def test_single_process_collectives_are_identities(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    env = mg.init(seed=7)
    assert (env.rank, env.world_size, env.backend, env.is_main()) == (0, 1, "none", True)
    assert mg.device() == torch.device("cpu")
    t = torch.arange(3.0)
    assert mg.gather(t) is t and mg.all_reduce(t, "mean") is t
    assert mg.gather([1, 2]) == [1, 2] and mg.gather({"a": 1}) == [{"a": 1}]
    assert mg.shard([1, 2, 3]) == [1, 2, 3]
    mg.barrier()
    a = torch.rand(2)
    mg.shutdown()
    mg.init(seed=7)
    assert torch.equal(a, torch.rand(2))  # seeded the same way again


def test_init_is_idempotent_and_warns_on_new_settings(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    first = mg.init(threads=1)
    assert mg.init(threads=1) is first
    with pytest.warns(UserWarning, match="will not take effect"):
        assert mg.init(threads=2) is first


def test_context_manager_shuts_down(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with mg.init() as env:
        assert env.world_size == 1 and mg.is_initialized()
    assert not mg.is_initialized()


def test_one_rank_process_group(single_rank_group):
    """A real (one-rank) gloo group: the tier-1 fixture works and collectives run through torch."""
    import torch.distributed as dist

    assert single_rank_group.world_size == 1 and dist.get_world_size() == 1
    assert mg.gather(torch.ones(2)).tolist() == [1.0, 1.0]
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]
