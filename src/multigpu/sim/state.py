"""Agents as a struct of arrays: named 1-D tensors of compact dtypes (inside each rank).

``AgentState`` holds this rank's agents in preallocated buffers (``capacity``
rows, the first ``n`` alive) so migration appends and removes without
re-allocating every step. A chunk is a dict of views into the buffers, so a
substep updates agents in place.

Records travel between ranks as one ``uint8`` matrix ``[k, bytes_per_agent]``
(every field's bytes side by side), so one all-to-all moves every field.

    state = AgentState({"id": torch.int32, "x": torch.int16, "y": torch.int16, "state": torch.uint8}, capacity=100)
    state.bytes_per_agent        # 9
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

__all__ = ["AgentState"]


class AgentState:
    """This rank's agents: ``fields[name][:n]`` for each named field.

    Args:
        schema: Field name -> dtype; must contain ``"id"`` (int32).
        capacity: Rows to allocate up front (grows by 1.25x + 1024 when exceeded).
        device: Where the buffers live.
    """

    def __init__(self, schema: Mapping[str, torch.dtype], capacity: int = 0, device: torch.device | str = "cpu"):
        if "id" not in schema:
            raise ValueError("an agent schema needs an 'id' field")
        self.schema = dict(schema)
        self.device = torch.device(device)
        self.n = 0
        self.buffers = {k: torch.empty(capacity, dtype=dt, device=self.device) for k, dt in self.schema.items()}

    @property
    def capacity(self) -> int:
        return self.buffers["id"].shape[0]

    @property
    def bytes_per_agent(self) -> int:
        """Bytes of state per agent, the id included."""
        return sum(torch.empty(0, dtype=dt).element_size() for dt in self.schema.values())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, name: str) -> torch.Tensor:
        """The live part of field ``name`` (a view)."""
        return self.buffers[name][: self.n]

    def chunks(self, size: int) -> Iterator[dict[str, torch.Tensor]]:
        """Views of at most ``size`` agents at a time, covering the live agents once."""
        for start in range(0, self.n, size):
            stop = min(start + size, self.n)
            yield {k: b[start:stop] for k, b in self.buffers.items()}

    def reserve(self, capacity: int) -> None:
        """Make room for ``capacity`` agents, keeping the live ones."""
        if capacity <= self.capacity:
            return
        for k, b in self.buffers.items():
            grown = torch.empty(capacity, dtype=b.dtype, device=self.device)
            grown[: self.n] = b[: self.n]
            self.buffers[k] = grown

    def append(self, fields: Mapping[str, torch.Tensor]) -> None:
        """Add agents given as one tensor per field (every field of the schema)."""
        k = fields["id"].shape[0]
        if self.n + k > self.capacity:
            self.reserve(int((self.n + k) * 1.25) + 1024)
        for name, b in self.buffers.items():
            b[self.n : self.n + k] = fields[name]
        self.n += k

    def take(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Copies of the agents at ``index`` (positions among the live agents)."""
        return {k: b[: self.n][index] for k, b in self.buffers.items()}

    def remove(self, index: torch.Tensor) -> None:
        """Drop the agents at ``index`` (unique positions), filling holes from the tail: O(len(index))."""
        k = index.numel()
        if k == 0:
            return
        new_n = self.n - k
        gone = torch.zeros(k, dtype=torch.bool, device=self.device)
        tail = torch.arange(new_n, self.n, device=self.device)
        # survivors in the tail move into the holes left below new_n
        removed_in_tail = index[index >= new_n] - new_n
        gone[removed_in_tail] = True
        movers = tail[~gone]
        holes = index[index < new_n]
        for b in self.buffers.values():
            b[holes] = b[movers]
        self.n = new_n

    def pack(self, fields: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The agents in ``fields`` as a ``uint8`` matrix ``[k, bytes_per_agent]`` (one record per row)."""
        k = fields["id"].shape[0]
        cols = [fields[name].contiguous().view(torch.uint8).reshape(k, fields[name].element_size()) for name in self.schema]
        return torch.cat(cols, dim=1) if cols else torch.empty(k, 0, dtype=torch.uint8)

    def unpack(self, records: torch.Tensor) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`pack`."""
        out, col = {}, 0
        k = records.shape[0]
        for name, dt in self.schema.items():
            width = torch.empty(0, dtype=dt).element_size()
            block = torch.empty((k, width), dtype=torch.uint8, device=records.device)
            block.copy_(records[:, col : col + width])  # a fresh buffer: .contiguous() may keep a size-1 row's stride
            out[name] = block.view(dt).reshape(k)
            col += width
        return out

    def sorted_by_id(self) -> dict[str, torch.Tensor]:
        """Copies of every live field, ordered by agent id (what split-independence compares)."""
        order = torch.argsort(self["id"].to(torch.int64))
        return {k: self[k][order] for k in self.schema}

    def digest_sum(self, chunk: int = 1 << 22) -> int:
        """An order-independent hash of the live agents: the sum of one 32-bit hash per agent record.

        Sums add across ranks (all-reduce) into a digest of the whole population that does not depend
        on how agents are split or ordered: equal digests mean equal agent states (up to hash collisions).
        """
        from multigpu.checkpoint.resize import records_digest

        total = 0
        for start in range(0, self.n, chunk):
            total += records_digest(self.pack({k: self[k][start : start + chunk] for k in self.schema}))
        return total

    def reorder(self, order: torch.Tensor) -> None:
        """Permute the live agents (one field at a time, so the temporary is one field).

        ``index_select`` + ``copy_``: 4-5x faster on CPU than ``b[:n] = b[:n][order]`` (measured, 5M agents).
        """
        for b in self.buffers.values():
            live = b[: self.n]
            live.copy_(torch.index_select(live, 0, order))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: self[k].clone() for k in self.schema}
