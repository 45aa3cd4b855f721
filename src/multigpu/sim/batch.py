"""Many replicates of a small model at once, in one engine: a batch of populations (inside one rank, alone).

A replicate of a few thousand agents spends most of each step in Python and in
the fixed cost of each tensor operation, not in arithmetic. A batch runs B
replicates as one population of ``B * N`` agents: agent ``i`` of replicate ``b``
is row ``b * N + i``, keyed by its own id ``i`` and its replicate's seed, its
contact network is its replicate's graph shifted by ``b * N`` (replicates never
touch), and each series is summed per replicate. Every operation is the
unbatched model's, on integers: replicate ``b`` of a batch gives bit for bit the
series of a :class:`~multigpu.sim.engine.SimEngine` run with its seed
(tests/unit/test_sim_batch.py holds them side by side).

The batched form exists for ``network_sir`` (the built-in SIR on a contact
network); other models run one engine per replicate. :func:`auto_batch` sizes a
batch so it holds about :data:`BATCH_AGENTS` agents.
"""

from __future__ import annotations

import torch

from multigpu.errors import ConfigError
from multigpu.sim import native, network, rng
from multigpu.sim.api import Context, get_model, model_params
from multigpu.sim.models import I, R, S, infection_table

__all__ = ["BATCH_AGENTS", "auto_batch", "run_batch", "supports"]

BATCH_AGENTS = 1 << 18
"""Agents one batch holds at most (its replicates times their agents): past this a batch runs no faster per
agent than one replicate alone, and its graphs take memory (measured: benchmarks/sim_starsim.py --batch)."""
MAX_BATCH = 64
_EDGE_CHUNK = 1 << 20


def supports(cfg) -> bool:
    """Whether ``cfg`` has a batched form: the built-in network_sir, its own substeps, agents from its init."""
    return (cfg.model == "network_sir" and not cfg.substeps and not cfg.population
            and cfg.network.kind in ("households", "random", "geometric"))


def auto_batch(cfg) -> int:
    """Replicates per batch for ``cfg``: as many as fit :data:`BATCH_AGENTS` agents (1: no batch)."""
    if not supports(cfg):
        return 1
    return max(1, min(MAX_BATCH, BATCH_AGENTS // max(1, cfg.agents)))


def _edges(cfg, seeds: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every replicate's edges (made from its seed as its own engine makes them, self-loops dropped as there),
    shifted to its rows: (src, dst), int64, on the CPU (sizes read on the host, as the engine's graph setup)."""
    src, dst = [], []
    for b, seed in enumerate(seeds):
        edges = network.incoming(cfg.network, n, seed)  # one rank: every edge into this replicate's agents
        edges = edges[edges[:, 0] != edges[:, 1]] + b * n
        src.append(edges[:, 0])
        dst.append(edges[:, 1])
    return torch.cat(src), torch.cat(dst)


def run_batch(cfg, seeds: list[int], device: torch.device | str = "cpu") -> list[dict[str, list]]:
    """Run ``cfg`` once per seed, all at once; returns each replicate's series (``step``, S, I, R) in order.

    Call on one rank working alone (``group.alone()``): the graphs are built as a one-rank run builds them.
    """
    if not supports(cfg):
        raise ValueError(f"model {cfg.model!r} has no batched form; run one engine per replicate")
    model = get_model(cfg.model)
    params = model_params(model, cfg.params)
    n, batch = cfg.agents, len(seeds)
    ids = torch.arange(n, dtype=torch.int32, device=device)
    state = torch.cat([model.init(Context(seed=s, step=-1, params=params, grid=tuple(cfg.grid), rows=cfg.grid[0],
                                          num_agents=n, env=model.env(params)), ids)["state"] for s in seeds])
    src, dst = (t.to(device) for t in _edges(cfg, seeds, n))
    sparse = torch.device(device).type == "cpu"
    c_loops = sparse and cfg.native != "off" and native.available()  # the engine's C kernels: the same results
    if sparse:  # grouped by source once: a step visits only the edges out of the infected
        out_edges = network.by_source(src, dst, batch * n, c_loops)
    if cfg.native == "on" and sparse and not c_loops:
        raise ConfigError("sim.native=on, but the C kernels could not be built (no working C compiler: cc, or $CC); "
                          "valid: native=auto (torch kernels where they cannot be built) or off")
    transition = native.kernels()["net_transition"] if c_loops else None
    mixed = rng.mix_ids(ids).repeat(batch).view(batch, n)  # random_bits' first half, once
    table = infection_table(params.beta).to(device)
    recover = rng.threshold(params.gamma)
    counts = torch.zeros((cfg.steps, batch, 3), dtype=torch.int64, device=device)
    scratch = torch.empty(batch * n, dtype=torch.int32) if c_loops else None
    for step in range(cfg.steps):
        if c_loops and native.net_batch_step(*out_edges, ids, state, [rng.step_key(s, step, rng.STREAM_TRANSITION)
                                                                      for s in seeds], table, recover, scratch,
                                             counts[step]):
            continue  # the whole step in C: the same counts and states as the torch code below
        # per agent, its infected neighbours (exact integer sums). CPU: only the edges from an infected agent, counted
        # by their end; a GPU adds every edge (selecting them would read their count on the host each step)
        infected = state == I
        inbox = torch.zeros(batch * n, dtype=torch.int64, device=device)
        if sparse:
            network.spread(*out_edges, infected, inbox, c_loops)
        else:
            for start in range(0, dst.numel(), _EDGE_CHUNK):  # bounded temporaries, as the unbatched graph
                stop = min(start + _EDGE_CHUNK, dst.numel())
                inbox.index_add_(0, dst[start:stop], infected[src[start:stop]].to(torch.int64))
        thr = table[inbox.clamp(max=table.numel() - 1)]
        keys = torch.tensor([rng.step_key(s, step, rng.STREAM_TRANSITION) for s in seeds], dtype=torch.int32,
                            device=device)
        if transition is not None:  # one C loop per replicate, on its rows
            for b, key in enumerate(keys.tolist()):
                rows = slice(b * n, (b + 1) * n)
                counts[step, b] = transition(ids, state[rows], thr[rows], key, recover)
            continue
        u = rng.low_bits(rng.hash32(mixed ^ keys[:, None]).view(-1), 24, shift=8)  # = random_bits(id, its key)
        state = torch.where((state == S) & (u < thr), I,
                            torch.where((state == I) & (u < recover), R, state)).to(torch.uint8)
        by_replicate = state.view(batch, n)
        counts[step] = torch.stack([(by_replicate == k).sum(1) for k in (S, I, R)], 1)
    rows = counts.permute(1, 2, 0).tolist()  # [batch][series][step]: one host read
    steps = list(range(1, cfg.steps + 1))
    return [{"step": list(steps), "S": r[0], "I": r[1], "R": r[2]} for r in rows]
