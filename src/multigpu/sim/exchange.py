"""What crosses between ranks each step: field sums, halos, migrating agents (inside each rank).

Every function is a collective: call it on all ranks, in the same order. With
``world_size == 1`` each is a local operation (no process group exists).

* :func:`sum_field` - all-reduce of an integer field (exact, so independent of the split);
* :func:`halo` - the ``radius`` rows above and below this rank's strip, from its neighbours
  (periodic), gathered with one all-gather of every rank's border rows;
* :func:`migrate` - all-to-all of agent records: counts first, then one ``uint8``
  matrix of packed records (every field at once). With ``overlap=True`` both
  all-to-alls are started asynchronously and the local work that does not need
  them (packing the leaving agents while the counts travel, removing them while
  the records travel) runs meanwhile; the result is the same agents in the same
  order. Each wait is bounded by the job's collective timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from multigpu.runtime import collectives, group
from multigpu.runtime.collectives import timed_collective  # times the call and rewrites torch's errors
from multigpu.sim.state import AgentState

__all__ = ["finish", "halo", "migrate", "start_sum", "sum_field"]


def _world() -> int:
    return group.world_size()


def sum_field(field: torch.Tensor) -> torch.Tensor:
    """Sum an integer field over all ranks, in place (exact). Call on all ranks."""
    if _world() == 1:
        return field
    return collectives.all_reduce(field, "sum", check_shapes=False)


def halo(rows: torch.Tensor, radius: int) -> torch.Tensor:
    """``rows`` [h, W] with ``radius`` rows from the rank above and below added: [h + 2 * radius, W].

    Rank r's upper neighbour is r - 1 and its lower one r + 1, wrapping round
    (the grid is periodic). Each strip must be at least ``radius`` rows high.
    Call on all ranks.
    """
    if radius == 0:
        return rows
    borders = torch.cat([rows[:radius], rows[-radius:]])  # my top rows, then my bottom rows
    world = _world()
    every = borders
    if world > 1:  # every rank's border rows have this shape by construction: no shape exchange (a host sync)
        parts = [torch.empty_like(borders) for _ in range(world)]
        collectives.record_traffic("all_gather", borders.numel() * borders.element_size())
        with timed_collective("halo", borders.device):  # on CUDA: timed by events on the stream, not the host clock
            dist.all_gather(parts, borders)
        every = torch.cat(parts)
    r, p = (group.rank() if world > 1 else 0), world
    above = every[((r - 1) % p) * 2 * radius + radius : ((r - 1) % p) * 2 * radius + 2 * radius]
    below = every[((r + 1) % p) * 2 * radius : ((r + 1) % p) * 2 * radius + radius]
    return torch.cat([above, rows, below])


def start_sum(field: torch.Tensor):
    """Start summing an integer field over all ranks, in place; :func:`finish` the handle. Call on all ranks."""
    if _world() == 1:
        return None
    collectives.record_traffic("all_reduce", field.numel() * field.element_size())
    with timed_collective("all_reduce", field.device):
        return dist.all_reduce(field, op=dist.ReduceOp.SUM, async_op=True)


def finish(work, op: str = "all_reduce", device: torch.device | None = None) -> None:
    """Wait for an async collective (None: nothing to wait for), at most the job's collective timeout;
    a timeout or a lost peer raises multigpu's error naming this rank and ``op``. ``device``: the collective's
    tensors' (on CUDA the wait is timed on the stream: how long it held the stream up, what overlap left)."""
    if work is None:
        return
    with timed_collective(op, device):
        work.wait(timedelta(seconds=group.timeout_s()))


def migrate(state: AgentState, index: torch.Tensor, dest: torch.Tensor, *, overlap: bool = False) -> int:
    """Send the agents at positions ``index`` to ranks ``dest`` and take in the agents sent here.

    Removes the senders from ``state`` and appends the received agents (their
    order is rank order, then the senders' order). Call on all ranks, even with
    nothing to send. ``overlap``: run the local work while the all-to-alls travel
    (same result). Returns the number of agents received.
    """
    world = _world()
    if world == 1:
        if index.numel():
            raise RuntimeError("migrate() with one rank has nowhere to send agents")
        return 0
    order = torch.argsort(dest, stable=True)
    index, dest = index[order], dest[order]
    dest64 = dest.to(torch.int64)  # index_add_, not bincount: bincount reads its size back from a GPU
    send_counts = torch.zeros(world, dtype=torch.int64, device=dest.device).index_add_(0, dest64, torch.ones_like(dest64))
    recv_counts = torch.empty_like(send_counts)
    collectives.record_traffic("all_to_all", send_counts.numel() * send_counts.element_size())
    with timed_collective("migrate", send_counts.device):
        work = dist.all_to_all_single(recv_counts, send_counts, async_op=overlap)
    records = state.pack(state.take(index))  # with overlap: while the counts travel
    finish(work, "migrate", send_counts.device)  # synchronous: work is None
    width = state.bytes_per_agent
    received = torch.empty((int(recv_counts.sum()), width), dtype=torch.uint8, device=records.device)
    collectives.record_traffic("all_to_all", records.numel())  # uint8 records: one byte each
    with timed_collective("migrate", records.device):
        work = dist.all_to_all_single(received.view(-1), records.view(-1), (recv_counts * width).tolist(),
                                      (send_counts * width).tolist(), async_op=overlap)
    state.remove(torch.sort(index).values)  # with overlap: while the records travel (records is a copy)
    finish(work, "migrate", records.device)
    state.append(state.unpack(received))
    return received.shape[0]
