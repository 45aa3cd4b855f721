"""``SimEngine``: one rank's share of a simulation, stepped in lockstep with the others (inside each rank).

    engine = SimEngine(cfg)          # call on all ranks: each creates its agents
    engine.run(100)                  # collectives inside: every rank runs the same steps
    engine.series()                  # the per-step aggregates (reduced over ranks)

Strategies (``cfg.strategy``):

* ``data``: rank r holds agents ``shard_range(N)``; cell fields are summed over
  all ranks with an all-reduce (every ``sync_frequency`` steps; stale in between);
* ``spatial``: rank r holds the agents on grid rows ``[borders[r], borders[r+1])``;
  agents that step over a border migrate (all-to-all); fields need only halo rows;
* ``adaptive``: ``spatial``, with the borders moved every ``rebalance_every`` steps
  so each rank holds about the same number of agents.

Agents are processed in chunks of ``chunk_size`` so step temporaries stay
bounded (100M agents fit in a few GB); the built-in movement and SIR on the C
kernels, which keep no temporaries per agent, take a rank's agents in one call. An agent's update depends only on its
own state, its counter-based random numbers and exactly summed integer
fields, so every strategy and rank count gives the same agents and series.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist

from multigpu.errors import ConfigError
from multigpu.runtime import collectives, group
from multigpu.runtime.collectives import timed_collective  # times the call and rewrites torch's errors
from multigpu.runtime.sharding import shard_bounds
from multigpu.sim import exchange, models, native, network, partition, population, rules
from multigpu.sim.api import SUBSTEPS, Context, Substep, get_model, model_params
from multigpu.sim.config import SimConfig
from multigpu.sim.models import FUSED_KERNELS, KERNELS
from multigpu.sim.state import AgentState

__all__ = ["SimEngine"]

_INIT_BLOCK = 1 << 22  # agents created (and, under spatial strategies, sent to their owner) at a time


def _rows(prepared, start: int, n: int, total: int):
    """The rows [start, start + n) of every tensor in ``prepared`` that has one row per agent."""
    if isinstance(prepared, torch.Tensor):
        return prepared[start : start + n] if prepared.dim() and prepared.shape[0] == total else prepared
    if isinstance(prepared, (tuple, list)):
        return type(prepared)(_rows(p, start, n, total) for p in prepared)
    return prepared


def _compiled_on_first_call(kernel):
    """``torch.compile(kernel, dynamic=True)``, made when the kernel is first called: making it imports torch's
    compiler (dynamo, inductor: 2-3 CPU-seconds per rank), which the C kernels, where they replace it, never need."""
    compiled = None

    def run(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(kernel, dynamic=True)
        return compiled(*args, **kwargs)

    run.__name__ = getattr(kernel, "__name__", "kernel")
    run.__wrapped__ = kernel
    return run


class SimEngine:
    """This rank's agents, partition and aggregates; see the module docstring. Create on all ranks."""

    def __init__(self, cfg: SimConfig, *, populate: bool = True):
        self.cfg = cfg
        self.model = get_model(cfg.model)
        self.params = model_params(self.model, cfg.params)
        self.substeps: list[Substep] = [self.model.substep(n) for n in cfg.substep_names]
        self.world = group.world_size()
        self.rank = group.rank()
        cfg.check_world(self.world)
        self.device = group.current_device()
        self.num_agents = cfg.agents
        if cfg.population:  # the file decides how many agents there are
            self.num_agents, _ = population.columns(cfg.population, self.model.fields)
        self.spatial = cfg.strategy != "data"
        self.radius = max((s.halo(self.params) for s in self.substeps), default=0)
        height = cfg.grid[0]
        self.borders = partition.even_borders(height, self.world) if self.spatial else [0, height]
        self.ctx = Context(seed=cfg.seed, step=0, params=self.params, grid=tuple(cfg.grid),
                           num_agents=self.num_agents, env=self.model.env(self.params), kernels=self._kernels())
        self.state = AgentState(self.model.fields, 0, self.device)
        self.overlap = cfg.overlap == "on"  # auto: off (measured: no gain on gloo CPU ranks, benchmarks/history/simulation.md)
        self._inflight = None  # with overlap: (work, sums, pending) of the series all-reduce started by flush
        self.step_index = 0
        self.series_names = [n for s in self.substeps for n in s.series(self.params)]
        self.global_names = [n for s in self.substeps for n in s.globals(self.params)]
        self.history: dict[str, list] = {"step": [], **{n: [] for n in self.series_names + self.global_names}}
        self._pending: list[tuple[int, torch.Tensor, list]] = []  # (step, local sums, global values)
        self._stale: dict[str, torch.Tensor] = {}
        self.timers: dict[str, float] = defaultdict(float)
        self.rebalances: list[dict] = []
        self._row_owner: tuple[list[int], torch.Tensor] | None = None  # (borders, row -> rank) for _owner
        self._left_rows: dict[str, torch.Tensor] = {}  # GPU: substep -> "left agents off this rank's rows" flag
        self.after_substep = None  # after_substep(engine, substep): --check-split records every agent there
        self.uses_network = any(s.field == "network" for s in self.substeps)
        self.graph = None
        if self.uses_network:  # agents stay in id order on the rank that owns their id (see sim.network)
            t = time.perf_counter()
            self.graph = network.build(cfg.network, self.num_agents, cfg.seed, self.use_native).to(self.device)
            self.timers["network.build"] += time.perf_counter() - t
        if populate:
            self._populate()

    # ------------------------------------------------------------------ setup
    def _kernels(self) -> dict:
        kernels = dict(KERNELS)
        if self.device.type != "cpu":  # the same counts without reading how many agents are infected (a GPU sync)
            kernels.update(FUSED_KERNELS)
        if self.cfg.compile:
            kernels = {k: _compiled_on_first_call(f) for k, f in {**KERNELS, **FUSED_KERNELS}.items()}
        self.use_native = self._native()
        if self.use_native:
            kernels.update(native.kernels())  # one C loop per kernel: the same results (sim.native)
        return kernels

    def _native(self) -> bool:
        """Whether the C kernels of :mod:`multigpu.sim.native` run (``native: auto`` where they build, ``on``)."""
        if self.cfg.native == "off" or self.device.type != "cpu":
            return False
        if self.cfg.native == "on" and not native.available():
            raise ConfigError("sim.native=on, but the C kernels could not be built (no working C compiler: cc, "
                              "or $CC); valid: native=auto (torch kernels where they cannot be built) or off")
        return native.available()

    def _populate(self) -> None:
        """Create this rank's share of agent ids; spatial strategies then send each to its row's owner."""
        ids = range(*shard_bounds(self.num_agents, self.rank, self.world))
        blocks = max(1, -(-self.num_agents // (_INIT_BLOCK * self.world)))  # same count on every rank
        per = -(-len(ids) // blocks) if len(ids) else 0
        rows = (population.read_rows(self.cfg.population, self.model.fields, ids.start, ids.stop, per)
                if self.cfg.population and per else None)
        for b in range(blocks):
            start = ids.start + b * per
            stop = min(start + per, ids.stop)
            block = torch.arange(start, max(start, stop), dtype=torch.int32, device=self.device)
            first = self.state.n
            if rows is not None and stop > start:
                self.state.append(self._from_file(block, next(rows)[1]))
            else:
                self.state.append(self.initial_agents(block))
            if self.spatial:
                self._send_strays(first)
        if self._sorts():
            self.sort_by_row()

    def _sorts(self) -> bool:
        """Whether agents are reordered by row (never under a contact network: agents stay in id order)."""
        return self.model.spatial and bool(self.cfg.sort_every) and not self.uses_network

    def arrange_by_id(self) -> None:
        """Send every agent to the rank whose id range (shard_bounds) holds it, in id order. Call on all ranks."""
        if self.world > 1:
            dest = network.id_owner(self.state["id"], self.num_agents, self.world).to(torch.int32)
            away = torch.nonzero(dest != self.rank).reshape(-1)
            exchange.migrate(self.state, away, dest[away])
        self.state.reorder(torch.argsort(self.state["id"]))

    def _from_file(self, ids: torch.Tensor, columns: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Agents ``ids`` from a population file's rows: its columns, the other fields from ``init``."""
        where = f"sim.population {self.cfg.population}"
        if "id" in columns and not torch.equal(columns["id"].to(ids.device), ids):
            raise ValueError(f"{where}: the id column of rows {int(ids[0])}..{int(ids[-1])} is not the row number; "
                             "row i must be agent i")
        fields = {k: v.to(self.device) for k, v in columns.items()}
        if set(self.model.fields) - set(fields):
            fields = {**self.initial_agents(ids), **fields}
        allowed = self.model.values(self.params) if self.model.values is not None else {}
        for name in set(allowed) & set(columns):
            bad = population.unused_value(columns[name], allowed[name])
            if bad is not None:
                raise ValueError(population.unused_value_message(self.cfg.population, name, int(ids[bad[0]]), bad[1],
                                                                 self.model.name, allowed[name]))
        if self.model.spatial:
            for axis, size in (("x", self.cfg.grid[1]), ("y", self.cfg.grid[0])):
                v = fields[axis]
                if v.numel() and (int(v.min()) < 0 or int(v.max()) >= size):
                    raise ValueError(f"{where}: column {axis!r} has values outside the grid (0..{size - 1}; "
                                     f"found {int(v.min())}..{int(v.max())}); set grid=[height, width]")
        return fields

    def initial_agents(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's ``init`` for agents ``ids`` (int32), checked: every field, one value per agent, its dtype."""
        ctx = Context(seed=self.cfg.seed, step=-1, params=self.params, grid=tuple(self.cfg.grid),
                      rows=self.cfg.grid[0], num_agents=self.num_agents, env=dict(self.ctx.env))
        fields = self.model.init(ctx, ids)
        where = f"sim model {self.model.name!r}: init"
        if not isinstance(fields, dict):
            raise TypeError(f"{where} returned a {type(fields).__name__}; it must return {{field: tensor}}")
        missing = sorted(set(self.model.fields) - set(fields))
        if missing:
            raise ValueError(f"{where} returned no {missing}; it must return every field of the model")
        for name, dtype in self.model.fields.items():
            value = fields[name]
            if not isinstance(value, torch.Tensor) or value.shape != ids.shape or value.dtype != dtype:
                got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"{where} field {name!r} is {got}; want {dtype} {tuple(ids.shape)}")
        if not torch.equal(fields["id"], ids):
            raise ValueError(f"{where} changed the 'id' field; return the ids it was given")
        return fields

    # ------------------------------------------------------------------ one step
    def step(self) -> None:
        """Advance every agent one step. Call on all ranks."""
        if self._sorts() and self.step_index and self.step_index % self.cfg.sort_every == 0:
            # the order after the previous step's end, made when a step needs it (a run that stops there never
            # pays for a sort nothing reads)
            self.sort_by_row()
        ctx = self.ctx
        ctx.step = self.step_index
        ctx.lo, hi = (partition.rows_of(self.borders, self.rank) if self.spatial else (0, self.cfg.grid[0]))
        ctx.rows = hi - ctx.lo
        sums, values, early = [], [], None
        for i, sub in enumerate(self.substeps):
            prepared = sub.prepare(ctx, self._field(sub, early)) if sub.field else None
            following = self.substeps[i + 1] if i + 1 < len(self.substeps) else None
            sums_i, early = self._apply(sub, prepared, following)
            sums.extend(sums_i)
            values.extend(ctx.env["series"][n] for n in sub.globals(self.params))
            if self.after_substep is not None:
                self.after_substep(self, sub)
        local = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=self.device)
        # kept on the device: read on the host once per flush, not once per step (a GPU sync each)
        self._pending.append((self.step_index, local.to(torch.int64), values))
        self.step_index += 1
        if self.cfg.strategy == "adaptive" and self.step_index % self.cfg.rebalance_every == 0:
            self.rebalance()

    def _wants_cell_field(self, sub: Substep | None) -> bool:
        """Whether ``sub`` reads a fresh cell field this step (so it can be summed while agents move)."""
        if sub is None or sub.field != "cell":
            return False
        return self.spatial or self.ctx.step % self.cfg.sync_frequency == 0 or sub.name not in self._stale

    def _apply(self, sub: Substep, prepared, following: Substep | None):
        """Run one substep over every chunk; migrate the agents that left this rank's rows.

        When ``sub`` moves agents and ``following`` reads a cell field, each chunk's
        share of that field is added right after the chunk moved, while it is in
        cache (agents about to leave are counted by the rank that receives them).
        Returns (per-step sums, the early field accumulator or None).
        """
        start_t = time.perf_counter()
        ctx, total, strays = self.ctx, None, []
        early = None
        if sub.moves and self._wants_cell_field(following):
            early = self._new_cell_acc(following)
        fused = self._fuses(sub, following, early)
        # a user's substep without moves=True must leave every agent on this rank's rows (rule 5 of sim.api)
        user = SUBSTEPS.get(sub.name) is not sub
        watch = not sub.moves and self.spatial and self.world > 1 and user
        on_grid = sub.moves and user and self.device.type == "cpu"  # a GPU would wait for the host read
        for start, chunk in self._chunks(self._whole(sub)):
            if fused:  # move, count the infected, find the strays: one C pass per chunk
                out, away = models.move_and_count(ctx, chunk, early)
                total = out if total is None else total + out
                if self.spatial:
                    strays.append(away + start)
                continue
            if sub.field == "network":  # prepared holds one row per agent of this rank: this chunk's rows
                n = chunk["id"].shape[0]
                out = sub.apply(ctx, chunk, _rows(prepared, start, n, self.state.n))
            else:
                views = dict(chunk)
                out = sub.apply(ctx, chunk, prepared)
                for k, v in chunk.items():  # a field assigned (agents[k] = new), not updated in place
                    if v is not views[k]:
                        views[k].copy_(v)
            if out is not None:
                total = out.to(torch.int64) if total is None else total + out
            if early is not None:
                self._contribute(following, chunk, early)
            if watch:
                self._check_stayed(sub, chunk)
            if on_grid:
                rules.check_on_grid(sub, chunk, self.cfg.grid)
            if sub.moves and self.spatial and self.world > 1:  # one rank owns every row: no agent leaves
                y = chunk["y"]
                away = native.outside(y, ctx.lo, ctx.lo + ctx.rows) if self.use_native else None
                if away is None:
                    away = torch.nonzero((y < ctx.lo) | (y >= ctx.lo + ctx.rows)).reshape(-1)
                strays.append(away + start)
        self.timers[sub.name] += time.perf_counter() - start_t
        if sub.moves and self.spatial:
            t = time.perf_counter()
            index = torch.cat(strays) if strays else torch.zeros(0, dtype=torch.int64, device=self.device)
            before = self.state.n - index.numel()
            self._migrate(index)
            if early is not None and self.state.n > before:  # count the agents that just arrived
                arrived = {k: b[before : self.state.n] for k, b in self.state.buffers.items()}
                self._contribute(following, arrived, early)
            self.timers["migrate"] += time.perf_counter() - t
        if total is None:  # no agents here (or no sums): zeros on the device, stacked with the other substeps'
            total = torch.zeros(len(sub.series(self.params)), dtype=torch.int64, device=self.device)
        return list(total.reshape(-1)), early

    def _contribute(self, sub: Substep, agents: dict[str, torch.Tensor], acc: torch.Tensor) -> None:
        rules.contribute(sub, self.ctx, agents, acc)

    def _check_stayed(self, sub: Substep, chunk: dict[str, torch.Tensor]) -> None:
        flag = rules.check_stayed(sub, self.ctx, chunk, defer=self.device.type != "cpu")
        if flag is not None:  # on a GPU: kept on the device, read at the next flush (with the series)
            self._left_rows[sub.name] = flag if sub.name not in self._left_rows else self._left_rows[sub.name] | flag

    def _fuses(self, sub: Substep, following: Substep | None, early: torch.Tensor | None) -> bool:
        """Whether the built-in movement, then the built-in sir's count, run as one C pass per chunk."""
        return (self.use_native and early is not None and early.dim() == 1
                and sub.apply is models.move_apply and following.contribute is models.sir_contribute)

    def _new_cell_acc(self, sub: Substep) -> torch.Tensor:
        # one extra drop slot at the end for agents that count nowhere (see infected_kernel)
        channels = sub.channels(self.params)
        shape = (self.ctx.rows * self.cfg.grid[1] + 1, *((channels,) if channels > 1 else ()))
        return torch.zeros(shape, dtype=torch.int32, device=self.device)

    def _field(self, sub: Substep, early: torch.Tensor | None = None) -> torch.Tensor:
        """The field ``sub`` reads, summed over every rank (cell fields padded with halo rows)."""
        t = time.perf_counter()
        ctx, width = self.ctx, self.cfg.grid[1]
        if sub.field == "network":
            messages = [sub.contribute(ctx, chunk) for _, chunk in self._chunks()]
            self.timers[f"{sub.name}.field"] += time.perf_counter() - t
            t = time.perf_counter()
            inbox = self.graph.neighbour_sum(torch.cat(messages) if messages else
                                             torch.zeros(0, dtype=torch.int64, device=self.device))
            self.timers["exchange"] += time.perf_counter() - t
            return inbox
        if sub.field == "global":
            acc = torch.zeros(sub.field_size, dtype=torch.int64, device=self.device)
            for _, chunk in self._chunks():
                self._contribute(sub, chunk, acc)
            self.timers[f"{sub.name}.field"] += time.perf_counter() - t
            return exchange.sum_field(acc)
        if not self._wants_cell_field(sub):  # data strategy, sync_frequency > 1: the last summed field
            return self._stale[sub.name]
        acc = early
        if acc is None:
            acc = self._new_cell_acc(sub)
            for _, chunk in self._chunks():
                self._contribute(sub, chunk, acc)
        acc = acc[:-1]
        self.timers[f"{sub.name}.field"] += time.perf_counter() - t
        t = time.perf_counter()
        shape = (ctx.rows, width, *acc.shape[1:])
        rows, r = acc.view(shape), self.radius
        if self.spatial:
            padded = exchange.halo(rows, r)
        else:
            rows = exchange.sum_field(acc.contiguous()).view(shape)
            padded = torch.cat([rows[ctx.rows - r :], rows, rows[:r]]) if r else rows
        self.timers["exchange"] += time.perf_counter() - t
        self._stale[sub.name] = padded
        return padded

    def _chunks(self, whole: bool = False) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        size = max(self.cfg.chunk_size, self.state.n) if whole else self.cfg.chunk_size
        for i, chunk in enumerate(self.state.chunks(size)):
            yield i * size, chunk

    def _whole(self, sub: Substep) -> bool:
        """Whether ``sub`` runs on all of this rank's agents in one call: the built-in movement and SIR
        substeps on the C kernels, which keep no temporaries per agent, so chunks bound nothing there and each
        chunk's call cost Python time (~70 us: a 5M-agent rank spent 15% of its step on 20 chunks)."""
        return self.use_native and sub.apply in (models.move_apply, models.sir_apply)

    def sort_by_row(self) -> None:
        """Order this rank's agents by grid row so each chunk's cell lookups stay in cache."""
        t = time.perf_counter()
        order = native.row_order(self.state["y"], self.cfg.grid[0]) if self.use_native else None
        if order is None:
            order = torch.argsort(self.state["y"], stable=True)
        if not (self.use_native and native.permute([self.state[k] for k in self.state.schema], order)):
            self.state.reorder(order)
        self.timers["sort"] += time.perf_counter() - t

    # ------------------------------------------------------------------ spatial strategies
    def _owner(self, y: torch.Tensor) -> torch.Tensor:
        # made on the CPU once per set of borders (on a GPU, repeat_interleave would wait for it)
        if self._row_owner is None or self._row_owner[0] != self.borders:
            self._row_owner = (list(self.borders), partition.row_owner(self.borders).to(self.device))
        return self._row_owner[1][y.to(torch.int64)]

    def _send_strays(self, first: int = 0) -> None:
        """Send the agents at positions >= ``first`` whose row another rank owns. Call on all ranks."""
        if self.world == 1:  # every row is this rank's (and nonzero would wait for a GPU)
            return
        dest = self._owner(self.state["y"][first:])
        index = torch.nonzero(dest != self.rank).reshape(-1)
        self._migrate(index + first, dest[index])

    def _migrate(self, index: torch.Tensor, dest: torch.Tensor | None = None) -> None:
        if self.world == 1:
            return
        if dest is None:
            dest = self._owner(self.state["y"][index])
        exchange.migrate(self.state, index, dest, overlap=self.overlap)

    def rebalance(self) -> dict:
        """Move the strip borders so each rank holds about the same number of agents. Call on all ranks."""
        t = time.perf_counter()
        height = self.cfg.grid[0]
        rows = torch.zeros(height, dtype=torch.int64, device=self.device)
        for _, chunk in self._chunks():
            y = chunk["y"].to(torch.int64)  # index_add_, not bincount: its size is not read from a GPU
            rows.index_add_(0, y, torch.ones_like(y))
        rows = exchange.sum_field(rows)
        before = self.agent_counts()
        self.borders = partition.balanced_borders(rows.cpu(), self.world)
        self._send_strays(0)
        after = self.agent_counts()
        record = {"step": self.step_index, "imbalance_before": partition.imbalance(before),
                  "imbalance_after": partition.imbalance(after), "borders": list(self.borders)}
        self.rebalances.append(record)
        self.timers["rebalance"] += time.perf_counter() - t
        return record

    def agent_counts(self) -> list[int]:
        """Agents on each rank. Call on all ranks."""
        if self.world == 1:
            return [self.state.n]
        # a CPU tensor (the gloo half of an NCCL group), one number on every rank: no shape check (a GPU sync)
        mine = torch.tensor([self.state.n], dtype=torch.int64)
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        collectives.record_traffic("all_gather", mine.numel() * mine.element_size())
        with timed_collective("agent_counts"):
            dist.all_gather(parts, mine)
        return torch.cat(parts).tolist()

    # ------------------------------------------------------------------ results
    def flush(self, *, wait: bool = True) -> None:
        """Sum the pending per-step aggregates over ranks into ``history``. Call on all ranks.

        ``wait=False`` (``overlap``) starts the sum and returns; it lands in ``history`` at the next
        flush, while the next steps run.
        """
        self._land()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        total = torch.stack([s for _, s, _ in pending])
        self._inflight = (exchange.start_sum(total) if total.numel() else None, total, pending)
        if wait:
            self._land()

    def _land(self) -> None:
        """Wait for the series sum in flight (if any) and append it to ``history``."""
        if self._inflight is None:
            return
        work, total, pending = self._inflight
        self._inflight = None
        exchange.finish(work, device=total.device)
        flags, self._left_rows = self._left_rows, {}
        rules.raise_if_left_rows(flags)
        for (step, _, values), row in zip(pending, total.tolist(), strict=True):
            self.history["step"].append(step + 1)
            for name, v in zip(self.series_names, row, strict=True):
                self.history[name].append(int(v))
            for name, v in zip(self.global_names, values, strict=True):
                self.history[name].append(v)

    def series(self) -> dict[str, list]:
        """The per-step aggregates so far (step 1 is the state after the first step). Call on all ranks."""
        self.flush()
        return {k: list(v) for k, v in self.history.items()}

    def log_point(self) -> None:
        """After a step: at every ``log_every``-th one, sum the series over the ranks (with ``overlap`` the sum
        travels during the next steps). Call on all ranks."""
        if self.cfg.log_every and self.step_index % self.cfg.log_every == 0:
            self.flush(wait=not self.overlap)

    def run(self, steps: int | None = None) -> dict[str, list]:
        """Run ``steps`` steps (default: until ``cfg.steps``); returns the aggregates. Call on all ranks.

        (``multigpu.sim.run`` runs the same steps in a :class:`multigpu.run.Run`: meter, checkpoints, callbacks.)
        """
        end = self.cfg.steps if steps is None else self.step_index + steps
        while self.step_index < end:
            self.step()  # comm inside: field all-reduce / halo, agent migration
            self.log_point()
        return self.series()
