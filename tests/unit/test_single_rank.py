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


def test_device_before_init_is_the_device_init_would_choose(monkeypatch):
    """A torchrun script moved over changes only its device lines (``torch.cuda.set_device(local_rank)`` ->
    ``mg.device()``) and keeps its own ``init_process_group``: ``mg.device()`` must not need ``mg.init()``."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert mg.device() == torch.device("cpu")  # no GPU here: init would take the CPU
    assert not mg.is_initialized()  # it chose, it did not join


def test_a_launched_script_at_one_rank_gets_torchs_group_of_one_so_distributed_sampler_works(monkeypatch, tmp_path):
    """``init_process_group`` -> ``mg.init()`` in a torchrun script: at world size 1 (bench's baseline, verify's
    reference) ``DistributedSampler`` and DDP need torch's default group, which torchrun with one process gives."""
    import json

    import torch.distributed as dist
    from torch.utils.data.distributed import DistributedSampler

    from multigpu.runtime import context

    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(name, value)
    env = mg.init()
    assert env.backend == "none"  # multigpu's own collectives stay identities
    assert dist.is_initialized() and dist.get_world_size() == 1
    assert list(DistributedSampler(range(5), shuffle=False)) == [0, 1, 2, 3, 4]
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
    model(torch.ones(3, 2)).sum().backward()
    mg.shutdown()
    assert not dist.is_initialized()
    # a workload of ours (the run file names it) keeps the group-less single process
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps({"workload": "train", "config": {}, "run": {}}))
    monkeypatch.setenv(context.RUN_FILE_VAR, str(run_file))
    context.set_current(None)
    mg.init()
    assert not dist.is_initialized()
