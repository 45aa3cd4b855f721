"""What crosses between ranks each step: field sums, halos, migrating agents (inside each rank).

Every function is a collective: call it on all ranks, in the same order. With
``world_size == 1`` each is a local operation (no process group exists).

* :func:`sum_field` - all-reduce of an integer field (exact, so independent of the split);
* :func:`halo` - the ``radius`` rows above and below this rank's strip, from its neighbours
  (periodic), gathered with one all-gather of every rank's border rows;
* :func:`migrate` - all-to-all of agent records: counts first, then one ``uint8``
  matrix of packed records (every field at once).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from multigpu.runtime import collectives, group
from multigpu.runtime.collectives import _translate  # times the call and rewrites torch's errors
from multigpu.sim.state import AgentState

__all__ = ["halo", "migrate", "sum_field"]


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
    every = borders if world == 1 else collectives.all_gather(borders.contiguous())
    r, p = (group.rank() if world > 1 else 0), world
    above = every[((r - 1) % p) * 2 * radius + radius : ((r - 1) % p) * 2 * radius + 2 * radius]
    below = every[((r + 1) % p) * 2 * radius : ((r + 1) % p) * 2 * radius + radius]
    return torch.cat([above, rows, below])


def migrate(state: AgentState, index: torch.Tensor, dest: torch.Tensor) -> int:
    """Send the agents at positions ``index`` to ranks ``dest`` and take in the agents sent here.

    Removes the senders from ``state`` and appends the received agents (their
    order is rank order, then the senders' order). Call on all ranks, even with
    nothing to send. Returns the number of agents received.
    """
    world = _world()
    if world == 1:
        if index.numel():
            raise RuntimeError("migrate() with one rank has nowhere to send agents")
        return 0
    order = torch.argsort(dest, stable=True)
    index, dest = index[order], dest[order]
    send_counts = torch.bincount(dest.to(torch.int64), minlength=world)
    records = state.pack(state.take(index))
    recv_counts = torch.empty_like(send_counts)
    with _translate("migrate"):
        dist.all_to_all_single(recv_counts, send_counts)
    width = state.bytes_per_agent
    received = torch.empty((int(recv_counts.sum()), width), dtype=torch.uint8, device=records.device)
    with _translate("migrate"):
        dist.all_to_all_single(received.view(-1), records.view(-1),
                               (recv_counts * width).tolist(), (send_counts * width).tolist())
    state.remove(torch.sort(index).values)
    state.append(state.unpack(received))
    return received.shape[0]
