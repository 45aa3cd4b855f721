"""Real collectives across spawned gloo ranks (tier 2). Each spawn checks several properties."""

from __future__ import annotations

import time

import pytest
import torch

import multigpu as mg
from multigpu.errors import ShapeMismatchError
from multigpu.testing import RankFailedError, run_on_ranks

pytestmark = pytest.mark.dist


def _collectives_body(n_items: int) -> dict:
    env = mg.get_env()
    out: dict = {"rank": env.rank, "world": env.world_size, "backend": env.backend, "threads": torch.get_num_threads()}
    said = mg.rank_zero_only(lambda who: f"said by rank {mg.rank()} of {who}")  # one-per-job messages
    out["api"] = (mg.local_rank(), mg.backend(), said(env.world_size))
    items = list(range(n_items))
    mine = mg.shard(items)
    # tensors with uneven first dims come back in the original order
    rows = torch.tensor([[i, i * i] for i in mine], dtype=torch.int64).reshape(-1, 2)
    out["tensor_gather"] = mg.gather(rows)
    out["tensor_all_gather"] = mg.gather(rows, dst=None)
    out["object_gather"] = mg.gather([f"item{i}" for i in mine], dst=0)
    out["dict_gather"] = mg.gather({"rank": env.rank}, dst=env.world_size - 1)
    out["sum"] = mg.all_reduce(torch.tensor([float(env.rank + 1)]), "sum").item()
    out["mean"] = mg.all_reduce(torch.tensor([float(env.rank + 1)]), "mean").item()
    out["max"] = mg.all_reduce(torch.tensor([env.rank]), "max").item()
    out["bcast"] = mg.broadcast(torch.tensor([env.rank * 10 + 7]), src=env.world_size - 1).item()
    out["bcast_obj"] = mg.broadcast_object({"from": env.rank}, src=0)
    # a shape mismatch is an error on every rank, listing all shapes, not a hang
    try:
        mg.gather(torch.zeros(2, 3 + env.rank))
        out["mismatch"] = None
    except ShapeMismatchError as exc:
        out["mismatch"] = str(exc)
    try:
        mg.all_reduce(torch.zeros(1 + env.rank))
        out["reduce_mismatch"] = None
    except ShapeMismatchError as exc:
        out["reduce_mismatch"] = str(exc)
    # point to point: any shape and dtype arrive as sent, the receiver knowing nothing in advance
    from multigpu.runtime import collectives

    if env.rank == 0:
        out["received"] = [(collectives.recv(r), collectives.recv(r, tag=3)) for r in range(1, env.world_size)]
        collectives.send(torch.arange(4, dtype=torch.bfloat16).reshape(2, 2), env.world_size - 1)
    else:
        collectives.send(torch.full((env.rank, 3), float(env.rank)).t(), 0)  # not contiguous
        collectives.send(torch.empty(0, dtype=torch.int64), 0, tag=3)
        if env.rank == env.world_size - 1:
            out["from_rank0"] = collectives.recv(0)
    mg.barrier()
    # leaving through ``with env``: shutdown() waits at a barrier for the last rank, timed as a collective
    before = collectives.collective_seconds()
    time.sleep(0.5 if env.rank == env.world_size - 1 else 0)
    with env:
        pass
    out["leave"] = (collectives.collective_seconds() - before, mg.is_initialized())
    return out


@pytest.mark.parametrize("world_size,n_items", [(2, 7), (3, 10), (3, 2)])
def test_gather_order_reduce_broadcast_and_shape_errors(world_size, n_items):
    results = run_on_ranks(_collectives_body, world_size, args=(n_items,), timeout_s=90)
    expected_rows = [[i, i * i] for i in range(n_items)]
    for r, out in enumerate(results):
        assert (out["rank"], out["world"], out["backend"], out["threads"]) == (r, world_size, "gloo", 1)
        assert out["api"] == (r, "gloo", f"said by rank 0 of {world_size}" if r == 0 else None)  # one node
        assert out["tensor_all_gather"].tolist() == expected_rows
        assert out["sum"] == sum(range(1, world_size + 1))
        assert out["mean"] == pytest.approx(sum(range(1, world_size + 1)) / world_size)
        assert out["max"] == world_size - 1
        assert out["bcast"] == (world_size - 1) * 10 + 7
        assert out["bcast_obj"] == {"from": 0}
        assert "rank 0: (2, 3)" in out["mismatch"] and f"rank {world_size - 1}: (2, {2 + world_size})" in out["mismatch"]
        assert "the same shape on every rank" in out["reduce_mismatch"]
        waited, still_in = out["leave"]
        assert not still_in and (r == world_size - 1 or waited >= 0.3)  # the others waited for the last rank
    assert results[0]["tensor_gather"].tolist() == expected_rows
    assert results[0]["object_gather"] == [f"item{i}" for i in range(n_items)]
    assert all(out["tensor_gather"] is None for out in results[1:])
    assert results[-1]["dict_gather"] == [{"rank": r} for r in range(world_size)]
    assert all(out["dict_gather"] is None for out in results[:-1])
    for r, (full, empty) in enumerate(results[0]["received"], start=1):
        assert torch.equal(full, torch.full((r, 3), float(r)).t()) and full.dtype == torch.float32
        assert empty.shape == (0,) and empty.dtype == torch.int64
    assert torch.equal(results[-1]["from_rank0"], torch.arange(4, dtype=torch.bfloat16).reshape(2, 2))


def _raise_on_rank1() -> None:
    if mg.rank() == 1:
        raise ValueError("boom on rank 1")
    mg.barrier()


def _rank1_never_arrives() -> None:
    if mg.rank() == 1:
        time.sleep(60)
    mg.barrier()


def _rank0_sleeps() -> None:
    # both ranks meet first: rank 1 must not exit while rank 0 is still in init's gloo handshake (rank 0 then fails
    # with "Connection closed by peer" instead of sleeping past the deadline; seen once in a loaded full run)
    mg.barrier()
    time.sleep(60 if mg.rank() == 0 else 0)


def test_failing_rank_is_reported_with_its_own_traceback():
    with pytest.raises(RankFailedError, match="rank 1/2 raised") as info:
        run_on_ranks(_raise_on_rank1, 2, timeout_s=60)
    assert info.value.rank == 1 and "ValueError: boom on rank 1" in info.value.trace


def test_barrier_a_rank_never_reaches_names_it():
    """rank 0 waits at a barrier rank 1 never reaches: the collective timeout names rank 1."""
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_on_ranks(_rank1_never_arrives, 2, timeout_s=60, collective_timeout_s=3)
    assert time.monotonic() - start < 45
    assert info.value.rank == 0
    assert "CollectiveTimeoutError" in info.value.trace and "Ranks 1 failed to pass monitoredBarrier" in info.value.trace


def test_harness_deadline_dumps_the_stuck_ranks_stack():
    """The deadline counts from the moment both ranks have started: rank 1 has the whole of it to finish. It
    counted from the spawn, and on a loaded machine rank 1 once had not finished either when it passed (15 s, the
    call took 21.6 s)."""
    with pytest.raises(TimeoutError, match=r"ranks \[0\] did not finish within 10s") as info:
        run_on_ranks(_rank0_sleeps, 2, timeout_s=10)
    assert "--- rank 0 stack ---" in str(info.value) and "_rank0_sleeps" in str(info.value)
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not start within 0.001s \(the process, "):
        run_on_ranks(_rank0_sleeps, 2, startup_timeout_s=0.001)  # start-up has a deadline of its own


def _what_a_rank_sees(name: str) -> dict:
    import os
    import sys

    os.write(1, f"rank {mg.rank()} prints\n".encode())  # one write each, so the two ranks' lines do not interleave
    os.write(2, f"rank {mg.rank()} warns\n".encode())
    return {"var": os.environ.get(name), "path": sys.path[0], "cwd": os.getcwd()}


@pytest.fixture(scope="module")
def _server_started_elsewhere():
    """A first call outside the test, so the forkserver starts with other stdout/stderr than the test's capfd."""
    run_on_ranks(_what_a_rank_sees, 2, args=("MULTIGPU_TEST_SEEN",))


def test_ranks_get_the_callers_environment_path_and_output_at_each_call(_server_started_elsewhere, tmp_path,
                                                                         monkeypatch, capfd):
    """Ranks fork from a long-lived forkserver: each call still hands them the caller's current environment,
    ``sys.path`` and working folder, and their stdout/stderr go where the caller's go (here: capfd)."""
    monkeypatch.setenv("MULTIGPU_TEST_SEEN", "set after the first call")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    results = run_on_ranks(_what_a_rank_sees, 2, args=("MULTIGPU_TEST_SEEN",))
    assert results == [{"var": "set after the first call", "path": str(tmp_path), "cwd": str(tmp_path)}] * 2
    out, err = capfd.readouterr()
    assert sorted(line for line in out.splitlines() if line.startswith("rank ")) == ["rank 0 prints", "rank 1 prints"]
    assert sorted(line for line in err.splitlines() if line.startswith("rank ")) == ["rank 0 warns", "rank 1 warns"]


def _draws() -> list:
    import random

    import numpy
    import torch

    return [torch.initial_seed(), torch.rand(2).tolist(), random.random(), float(numpy.random.rand())]


def test_each_rank_draws_its_own_random_numbers(_server_started_elsewhere):
    """Issue 48: ranks forked from the long-lived forkserver drew its torch stream, the same on every rank (a new
    interpreter's, as under torchrun, is its own). torch's, Python's and NumPy's generators differ between ranks."""
    first, second = run_on_ranks(_draws, 2)
    assert all(a != b for a, b in zip(first, second, strict=True)), (first, second)



def _context_seen() -> dict:
    ctx = mg.run_context()
    return {"run_dir": ctx.run_dir, "timeout_s": ctx.timeout_s, "scaling": ctx.scaling}


def test_the_ranks_read_the_run_context_they_are_given(_server_started_elsewhere, tmp_path):
    """``run_on_ranks(..., ctx=RunContext(...))`` hands every rank that context, as the launcher's run file would
    (the GPU tests share one GPU between ranks this way)."""
    from multigpu.runtime.context import RunContext

    ctx = RunContext(run_dir=str(tmp_path), timeout_s=42.0, scaling="weak")
    assert run_on_ranks(_context_seen, 2, ctx=ctx) == [{"run_dir": str(tmp_path), "timeout_s": 42.0,
                                                          "scaling": "weak"}] * 2
