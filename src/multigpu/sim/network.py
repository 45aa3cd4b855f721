"""Contact networks: agents interact along the edges of a graph, split over ranks (inside each rank).

Rank r owns agents ``shard_bounds(N, r, P)`` (contiguous ids, kept in id
order) and the edges that point *to* them. A substep with ``field="network"``
gives each agent an integer message (``contribute(ctx, agents)`` -> ``[n]`` or
``[n, channels]``); the engine hands ``prepare`` each agent's *inbox*: the sum
of the messages of its neighbours, exact in any order. Messages of neighbours
on other ranks come in one all-to-all per step: the *halo of the graph*, the
states of the remote agents this rank's edges read, agreed once at setup.
Memory per rank: O((agents + edges) / ranks + halo).

Graphs (``network.kind``), all undirected, the same on any rank count:

* ``file``: an edge list, ``network.path``: ``.npz`` / folder of ``.npy`` /
  ``.csv`` / ``.parquet`` with columns ``src`` and ``dst`` (agent ids). Each rank
  reads its share of the rows in chunks and sends every edge to the owners
  of its two ends. Repeated edges count as many times; self-loops are dropped.
* ``households``: agents ``[h * size, (h + 1) * size)`` form household ``h`` (every
  pair linked), plus ``contacts`` random community links per agent
  (the partner is a hash of (seed, id, k)): households + the wider community.
* ``random``: ``contacts`` links started by each agent to partners drawn
  uniformly at random (a hash of (seed, id, k)): mean degree ``2 * contacts``
  (Starsim's ``RandomNet(n_contacts=2 * contacts, dynamic=False, uniform_targets=True)``);
* ``geometric``: a random geometric graph: agent i at (x, y) in the unit square,
  y stratified by id (agent i in the i-th N-th of the height, so an id range is
  a strip of space) and x uniform, both from counter-based hashes; agents
  closer than ``radius`` are linked. Integer coordinates: exact everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from multigpu.errors import ConfigError
from multigpu.runtime import group
from multigpu.runtime.sharding import shard_bounds
from multigpu.sim import rng

__all__ = ["KINDS", "Graph", "NetworkConfig", "build", "by_source", "id_owner", "spread"]

KINDS = ("none", "file", "households", "random", "geometric")
_COORD = 1 << 20  # geometric graph: coordinates are integers in [0, 2**20)
_EDGE_CHUNK = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkConfig:
    kind: str = "none"
    """none, file (an edge list at ``path``), households, random or geometric."""
    path: str = ""
    """file: the edge list (columns src, dst): .npz, .csv, .parquet or a folder of .npy."""
    household_size: int = 4
    """households: agents per household (every pair linked)."""
    contacts: int = 2
    """households and random: links to random partners started by each agent (mean degree: twice this)."""
    radius: float = 0.01
    """geometric: link agents closer than this (the unit square); mean degree about pi * radius**2 * N."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"sim.network.kind {self.kind!r} is not valid; valid: {', '.join(KINDS)}")
        if self.kind == "file" and not self.path:
            raise ConfigError("sim.network.kind=file needs sim.network.path (an edge list with columns src, dst)")
        if self.household_size < 1 or self.contacts < 0:
            raise ConfigError("sim.network: household_size must be >= 1 and contacts >= 0")
        if not 0.0 < self.radius <= 0.5:
            raise ConfigError(f"sim.network.radius={self.radius} is invalid; valid: 0 < radius <= 0.5")


def _world() -> tuple[int, int]:
    return group.rank(), group.world_size()


def id_owner(ids: torch.Tensor, n: int, world: int) -> torch.Tensor:
    """The rank that owns each of ``ids`` (of ``n`` agents over ``world`` ranks) under shard_bounds (lower ranks
    hold one more)."""
    base, extra = divmod(n, world)
    cut = extra * (base + 1)
    ids = ids.to(torch.int64)
    return torch.where(ids < cut, ids // (base + 1), extra + (ids - cut) // max(base, 1))


def by_source(src: torch.Tensor, dst: torch.Tensor, num_src: int,
              use_native: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Edges grouped by their source, for :func:`spread`: (``ptr`` [num_src + 1], ``targets``): the edges out of
    source ``s`` end at ``targets[ptr[s]:ptr[s + 1]]`` (int32 where every count fits: half the bytes per edge).
    ``use_native``: one counting sort in C (:func:`multigpu.sim.native.group`) where the library is built."""
    if use_native and dst.dtype == src.dtype == torch.int64 and dst.numel() == src.numel():
        from multigpu.sim import native

        got = native.group(src.contiguous(), dst.contiguous(), num_src)
        if got is not None:
            return got
    small = max(num_src, src.numel()) < 1 << 31
    index = torch.int32 if small else torch.int64
    order = torch.argsort(src.to(index), stable=True)
    ptr = torch.zeros(num_src + 1, dtype=index, device=src.device)
    torch.cumsum(torch.bincount(src, minlength=num_src), 0, out=ptr[1:])
    return ptr, dst[order].to(index)


def spread(ptr: torch.Tensor, targets: torch.Tensor, values: torch.Tensor, out: torch.Tensor,
           use_native: bool = False) -> torch.Tensor:
    """``out[t] += values[s]`` for every edge s -> t with ``values[s] != 0`` (``values``: [num_src] integers or
    bools): only the edges of the sources that send something are visited (an epidemic's infected are few), at
    most about ``_EDGE_CHUNK`` at a time. Exact integer sums, as adding over every edge. ``use_native``: one C
    loop (:func:`multigpu.sim.native.spread`) where the library is built. Returns ``out``."""
    if use_native:
        from multigpu.sim import native

        if native.spread(ptr, targets, values, out):
            return out
    active = torch.nonzero(values).reshape(-1).to(ptr.dtype)
    if not active.numel():
        return out
    starts = ptr[active]
    counts = ptr[active + 1] - starts
    ends = torch.cumsum(counts, 0, dtype=ptr.dtype)
    total = int(ends[-1])
    # split the active sources where their edges pass each multiple of _EDGE_CHUNK (a source is never split)
    marks = torch.arange(_EDGE_CHUNK, total, _EDGE_CHUNK, dtype=ptr.dtype, device=ptr.device) if total > _EDGE_CHUNK else ends[:0]
    cuts = torch.searchsorted(ends, marks).tolist()
    ones = values.dtype == torch.bool  # each edge adds 1: counted, no values to repeat
    lo = 0
    for hi in [*dict.fromkeys(c + 1 for c in cuts), active.numel()]:
        if hi <= lo:
            continue
        c, first = counts[lo:hi], ends[lo] - counts[lo]
        n = int(ends[hi - 1] - first)
        # position of each edge: its source's start, plus its rank among that source's edges
        pos = torch.arange(n, dtype=ptr.dtype, device=ptr.device) + torch.repeat_interleave(starts[lo:hi] - (ends[lo:hi] - c - first), c,
                                                                          output_size=n)
        if ones:
            out += torch.bincount(targets[pos], minlength=out.numel())
        else:
            out.index_add_(0, targets[pos], torch.repeat_interleave(values[active[lo:hi]].to(out.dtype), c,
                                                                     output_size=n))
        lo = hi
    return out

def _all_to_all(values: torch.Tensor, dest: torch.Tensor, world: int) -> tuple[torch.Tensor, list[int]]:
    """Rows of ``values`` ([k, w] int64) sent to ranks ``dest``: (the rows received in rank order, rows per rank)."""
    import torch.distributed as dist

    from multigpu.runtime.collectives import timed_collective

    if world == 1:
        return values, [values.shape[0]]
    order = torch.argsort(dest, stable=True)
    values = values[order].contiguous()
    send = torch.bincount(dest.to(torch.int64), minlength=world)
    recv = torch.empty_like(send)
    with timed_collective("network", send.device):
        dist.all_to_all_single(recv, send)
    w = values.shape[1]
    out = torch.empty((int(recv.sum()), w), dtype=values.dtype)
    with timed_collective("network", out.device):
        dist.all_to_all_single(out.view(-1), values.view(-1), (recv * w).tolist(), (send * w).tolist())
    return out, recv.tolist()


class Graph:
    """This rank's incoming edges (CSR by local agent) and the plan of its per-step halo exchange.

    Built on the CPU (setup: data-dependent sizes read on the host, routed over the CPU half of the
    process group), then placed on the engine's device with :meth:`to`, where every step runs.
    """

    def __init__(self, num_agents: int, incoming: torch.Tensor, symmetric: bool = False, use_native: bool = False):
        """``incoming``: [E, 2] int64 (src id, dst id) with every dst owned by this rank; ``symmetric``: every edge
        is there both ways (an undirected graph: :func:`build`'s); ``use_native``: the edges grouped by their
        destination with one counting sort in C (:func:`multigpu.sim.native.group`: the stable sort's order, in
        one pass; the argsort and its gathers were 80% of building a 200k-agent random network). Collective."""
        rank, world = _world()
        self.symmetric = symmetric
        self.num_agents = num_agents
        self.lo, self.hi = shard_bounds(num_agents, rank, world)
        src, dst = incoming[:, 0], incoming[:, 1]
        keep = src != dst  # self-loops do not count
        src, dst = src[keep], dst[keep]
        self._in_ptr: torch.Tensor | None = None  # the edges into each local agent, when grouped in C
        grouped = None
        if use_native and num_agents < 1 << 31:
            from multigpu.sim import native

            grouped = native.group((dst - self.lo).contiguous(), src.contiguous(), self.hi - self.lo)
        if grouped is not None:
            self._in_ptr, sources = grouped
            src = sources.to(torch.int64)
            self._dst = None  # the local positions, made from the counts by ``dst`` when something reads them
        else:
            order = torch.argsort(dst.to(torch.int32) if num_agents < 1 << 31 else dst, stable=True)
            src, dst = src[order], dst[order]
            self.dst = dst - self.lo  # local positions
        if world == 1:  # every source is local: no halo
            remote_ids, self.src_slot = src[:0], src - self.lo
        else:
            local = (src >= self.lo) & (src < self.hi)
            remote_ids, inverse = torch.unique(src[~local], return_inverse=True)  # sorted: by owner, then id
            self.src_slot = torch.empty_like(src)
            self.src_slot[local] = src[local] - self.lo
            self.src_slot[~local] = (self.hi - self.lo) + inverse
        self.num_halo = remote_ids.numel()
        self.num_edges = src.numel()
        # tell each owner which of its agents this rank reads; it sends their messages every step
        owners = id_owner(remote_ids, num_agents, world)
        asked, self.send_counts = _all_to_all(remote_ids[:, None], owners, world)
        self.recv_counts = torch.bincount(owners, minlength=world).tolist()
        self.send_index = asked[:, 0] - self.lo  # what the others read, in their rank order
        self._out = None  # the edges by source (CPU steps): see neighbour_sum
        self.native = use_native  # neighbour_sum on the CPU in C (the engine sets it where its C kernels run)

    @classmethod
    def grouped(cls, num_agents: int, ptr: torch.Tensor, sources: torch.Tensor) -> Graph:
        """One rank's whole undirected graph from its edges already grouped by destination (``ptr`` [n + 1], the
        ``sources`` in :meth:`__init__`'s order, no self-loops): what ``Graph(num_agents, incoming, symmetric=True,
        use_native=True)`` holds for the same edges."""
        graph = cls.__new__(cls)
        graph.symmetric, graph.num_agents, graph.lo, graph.hi = True, num_agents, 0, num_agents
        graph._in_ptr = ptr
        graph._dst = None  # made from ptr when something reads it (not the CPU step, which reads the groups)
        graph.src_slot = sources.to(torch.int64)
        graph.num_halo, graph.num_edges = 0, sources.numel()
        graph.send_counts, graph.recv_counts = [0], [0]
        graph.send_index = torch.zeros(0, dtype=torch.int64)
        graph._out, graph.native = None, True
        return graph

    @property
    def dst(self) -> torch.Tensor:
        """The local destination of every edge, in edge order ([E] int64)."""
        if self._dst is None:
            self._dst = torch.repeat_interleave(torch.arange(self.hi - self.lo, device=self._in_ptr.device),
                                                self._in_ptr.diff())
        return self._dst

    @dst.setter
    def dst(self, value: torch.Tensor) -> None:
        self._dst = value

    def to(self, device: torch.device | str) -> Graph:
        """This graph with its per-step index tensors on ``device`` (the engine's); returns self."""
        self.src_slot, self.send_index = (t.to(device) for t in (self.src_slot, self.send_index))
        if self._dst is not None:
            self._dst = self._dst.to(device)
        self._out = None
        if self._in_ptr is not None:
            self._in_ptr = self._in_ptr.to(device)
        return self

    def _by_source(self, num_src: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`by_source` of this rank's edges. Undirected with no halo: the edges out of an agent are those into
        it, already grouped by :meth:`__init__`'s sort (no second sort)."""
        if not (self.symmetric and self.num_halo == 0 and self.num_edges < 1 << 31):
            return by_source(self.src_slot, self.dst, num_src, self.native)
        if self._in_ptr is not None and self._in_ptr.numel() == num_src + 1:  # counted when the graph was built
            return self._in_ptr, self.src_slot.to(torch.int32)
        ptr = torch.zeros(num_src + 1, dtype=torch.int32, device=self.src_slot.device)
        torch.cumsum(torch.bincount(self.dst, minlength=num_src), 0, out=ptr[1:])
        return ptr, self.src_slot.to(torch.int32)

    def neighbour_sum(self, messages: torch.Tensor) -> torch.Tensor:
        """Per local agent, the sum of its neighbours' ``messages`` ([n] or [n, C] integers) as int64. Collective."""
        import torch.distributed as dist

        from multigpu.runtime.collectives import timed_collective

        msgs = messages.to(torch.int64)
        flat = msgs.reshape(msgs.shape[0], -1)
        width = flat.shape[1]
        table = flat
        if group.world_size() > 1:
            out = flat[self.send_index].contiguous()
            halo = torch.empty((self.num_halo, width), dtype=torch.int64, device=flat.device)
            with timed_collective("network halo", halo.device):  # on CUDA: timed on the stream (events)
                dist.all_to_all_single(halo.view(-1), out.view(-1), [c * width for c in self.recv_counts],
                                       [c * width for c in self.send_counts])
            table = torch.cat([flat, halo])
        inbox = torch.zeros_like(flat)
        # on the CPU, one number per agent: only the edges from agents with a nonzero message are added (the
        # same integer sums; an epidemic's infected are few). A GPU adds every edge: no host read of a count
        if width == 1 and flat.device.type == "cpu":
            if self._out is None:  # grouped by source once, on first use: then a step visits only their edges
                self._out = self._by_source(table.shape[0])
            return spread(*self._out, table.reshape(-1), inbox.reshape(-1), self.native).reshape(msgs.shape)
        for start in range(0, self.num_edges, _EDGE_CHUNK):  # bounded temporaries
            stop = min(start + _EDGE_CHUNK, self.num_edges)
            src, dst = self.src_slot[start:stop], self.dst[start:stop]
            inbox.index_add_(0, dst, table[src])
        return inbox.reshape(msgs.shape)


# ----------------------------------------------------------------------------- graphs
def _route(edges: torch.Tensor, num_agents: int) -> torch.Tensor:
    """Undirected edges [k, 2] (any rank) -> this rank's incoming directed edges (src, dst). Collective."""
    _, world = _world()
    both = torch.cat([edges, edges.flip(1)])
    if world == 1:  # every edge is this rank's
        return both
    return _all_to_all(both, id_owner(both[:, 1], num_agents, world), world)[0]


def _from_file(cfg: NetworkConfig, num_agents: int) -> torch.Tensor:
    from multigpu.sim import population

    fields = {"src": torch.int64, "dst": torch.int64}
    rank, world = _world()
    try:
        total = population.num_rows(cfg.path)
        heads = set(population.read_headers(Path(cfg.path)))
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("sim.population", "sim.network.path")) from None
    if heads != {"src", "dst"}:
        raise ConfigError(f"sim.network.path {cfg.path!r} has columns {sorted(heads)}; valid: src, dst")
    lo, hi = shard_bounds(total, rank, world)
    blocks = max(1, -(-total // (_EDGE_CHUNK * world)))  # the same number of routing rounds on every rank
    per = max(1, -(-(hi - lo) // blocks))
    reader = population.read_rows(cfg.path, fields, lo, hi, per, "sim.network.path") if hi > lo else iter(())
    parts = []
    for _ in range(blocks):
        got = next(reader, None)
        edges = torch.stack([got[1]["src"], got[1]["dst"]], 1) if got else torch.zeros((0, 2), dtype=torch.int64)
        if edges.numel() and (int(edges.min()) < 0 or int(edges.max()) >= num_agents):
            raise ValueError(f"sim.network.path {cfg.path}: edge ids must be agent ids 0..{num_agents - 1}; "
                             f"found {int(edges.min())}..{int(edges.max())}")
        parts.append(_route(edges, num_agents))
    return torch.cat(parts)


def _households(cfg: NetworkConfig, num_agents: int, seed: int, size: int | None = None) -> torch.Tensor:
    rank, world = _world()
    lo, hi = shard_bounds(num_agents, rank, world)
    ids = torch.arange(lo, hi, dtype=torch.int64)
    size = cfg.household_size if size is None else size
    first = (ids // size) * size
    # household links: this rank's agents' own incoming edges, no routing needed
    home = [torch.stack([first + j, ids], 1) for j in range(size)]
    home = torch.cat(home) if home else torch.zeros((0, 2), dtype=torch.int64)
    home = home[(home[:, 0] < num_agents) & (home[:, 0] != home[:, 1])]
    community = []
    for k in range(cfg.contacts):
        bits = rng.random_bits(ids.to(torch.int32), rng.step_key(seed, -2, 100 + k)).to(torch.int64) & 0x7FFFFFFF
        community.append(torch.stack([ids, (bits * num_agents) >> 31], 1))
    routed = _route(torch.cat(community) if community else torch.zeros((0, 2), dtype=torch.int64), num_agents)
    return torch.cat([home, routed])


def _positions(ids: torch.Tensor, num_agents: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer (x, y) in [0, 2**20) of agents ``ids``: y stratified by id (non-decreasing), x uniform."""
    i32 = ids.to(torch.int32)
    ux = rng.random_bits(i32, rng.step_key(seed, -2, 200)).to(torch.int64) & (_COORD - 1)
    uy = rng.random_bits(i32, rng.step_key(seed, -2, 201)).to(torch.int64) & (_COORD - 1)
    y = (ids * _COORD + uy) // num_agents
    return ux, y


def _geometric(cfg: NetworkConfig, num_agents: int, seed: int) -> torch.Tensor:
    rank, world = _world()
    lo, hi = shard_bounds(num_agents, rank, world)
    if hi == lo:
        return torch.zeros((0, 2), dtype=torch.int64)
    r = int(cfg.radius * _COORD)
    mine = torch.arange(lo, hi, dtype=torch.int64)
    x, y = _positions(mine, num_agents, seed)
    # the ids whose y can be within r: agent j has y in [j * C / N, (j + 1) * C / N)
    a = max(0, (int(y.min()) - r) * num_agents // _COORD - 1)
    b = min(num_agents, (int(y.max()) + r + 1) * num_agents // _COORD + 2)
    cand = torch.arange(a, b, dtype=torch.int64)
    cx, cy = _positions(cand, num_agents, seed)
    cells = _COORD // r + 1
    key = (cy // r) * cells + cx // r
    order = torch.argsort(key)
    key, cand, cx, cy = key[order], cand[order], cx[order], cy[order]
    most = int(torch.unique_consecutive(key, return_counts=True)[1].max())
    edges = []
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            qx, qy = x // r + dx, y // r + dy
            ok = (qx >= 0) & (qy >= 0)
            q = qy * cells + qx
            start = torch.searchsorted(key, q)
            stop = torch.searchsorted(key, q, right=True)
            for k in range(most):
                j = start + k
                hit = ok & (j < stop)
                jj = j.clamp(max=cand.numel() - 1)
                d2 = (cx[jj] - x) ** 2 + (cy[jj] - y) ** 2
                hit &= (d2 <= r * r) & (cand[jj] != mine)
                edges.append(torch.stack([cand[jj][hit], mine[hit]], 1))
    return torch.cat(edges)


def build(cfg: NetworkConfig, num_agents: int, seed: int, use_native: bool = False) -> Graph:
    """This rank's part of the graph ``cfg``. Call on all ranks. ``use_native``: sorted in C (:class:`Graph`);
    a random network on one rank generated there straight into its groups (:func:`multigpu.sim.native.random_graph`:
    the same edges in the same order, without the [E, 2] list, its masks and its sort)."""
    if use_native and cfg.kind == "random" and _world()[1] == 1 and num_agents < 1 << 31:
        from multigpu.sim import native

        keys = [rng.step_key(seed, -2, 100 + k) for k in range(cfg.contacts)]  # _households' keys
        grouped = native.random_graph(num_agents, keys)
        if grouped is not None:
            return Graph.grouped(num_agents, *grouped)
    return Graph(num_agents, incoming(cfg, num_agents, seed), symmetric=True,  # every kind is undirected
                 use_native=use_native)


def incoming(cfg: NetworkConfig, num_agents: int, seed: int) -> torch.Tensor:
    """The edges (src id, dst id) [E, 2] int64 into this rank's agents, self-loops included. Call on all ranks."""
    if cfg.kind == "file":
        edges = _from_file(cfg, num_agents)
    elif cfg.kind == "households":
        edges = _households(cfg, num_agents, seed)
    elif cfg.kind == "random":  # households of one: only the random links
        edges = _households(cfg, num_agents, seed, size=1)
    elif cfg.kind == "geometric":
        edges = _geometric(cfg, num_agents, seed)
    else:
        raise ConfigError("this model reads a contact network; set sim.network.kind to file, households, random or "
                          "geometric")
    return edges


def degrees(graph: Graph) -> torch.Tensor:
    """Edges into each of this rank's agents."""
    return torch.bincount(graph.dst, minlength=graph.hi - graph.lo)

