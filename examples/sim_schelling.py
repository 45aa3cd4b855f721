"""Schelling's segregation model, written only against the public model API (:mod:`multigpu.sim.api`).

Two groups of agents live on a periodic grid. An agent is *unhappy* when
fewer than ``tolerance`` of the other agents in its cell (``radius: 0``) or
its 3x3 neighbourhood (``radius: 1``) belong to its own group; an unhappy
agent moves to a random cell. Segregation grows step by step:
``same / neighbours`` in ``series.csv`` is the share of an agent's
neighbours that belong to its own group.

    multigpu sim --model examples.sim_schelling:MODEL --agents 1_000_000 grid=[500,500] --steps 50 \\
        --nproc-per-node 2 --strategy spatial params.tolerance=0.6
    multigpu sim --model examples.sim_schelling:MODEL --check-split      # same agents on 1 and 2 ranks?

The rules that keep it independent of the split: the per-cell group counts
are integers summed over ranks (a "cell" field with 2 channels), the
decision compares integers (``same * 2**16 < tolerance * 2**16 * others``) and
the new cell comes from the agent's own counter-based random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multigpu.errors import ConfigError
from multigpu.sim import Model, Substep, neighbourhood_sum, spawn_on_grid


@dataclass(frozen=True, kw_only=True)
class SchellingParams:
    share_a: float = 0.5
    """Share of agents in group 0 (the rest are group 1)."""
    tolerance: float = 0.5
    """An agent is unhappy when fewer than this share of its neighbours are of its own group."""
    radius: int = 1
    """Neighbourhood: 0 = the agent's cell, 1 = the 3x3 cells around it."""


def _check(p: SchellingParams) -> None:
    for name in ("share_a", "tolerance"):
        if not 0.0 <= getattr(p, name) <= 1.0:
            raise ConfigError(f"sim.params.{name}={getattr(p, name)} is invalid; valid: a share in [0, 1]")
    if p.radius not in (0, 1):
        raise ConfigError(f"sim.params.radius={p.radius} is invalid; valid: 0 or 1")


def init(ctx, ids):
    agents = spawn_on_grid(ids, ctx.seed, ctx.grid)  # id, x, y: uniform on the grid, from the id
    agents["group"] = (~ctx.bernoulli(ids, ctx.params.share_a, "group")).to(torch.uint8)
    return agents


def count_groups(ctx, agents, acc):
    """acc[cell, group] += 1 per agent (acc: [cells + 1, 2] int32; the last row is the engine's drop slot)."""
    acc.index_put_((ctx.cell(agents), agents["group"].to(torch.int64)),
                   torch.ones(agents["id"].shape[0], dtype=acc.dtype), accumulate=True)


def neighbourhood(ctx, counts):
    """[rows + 2 * radius, width, 2] summed counts -> per local cell, the counts within the radius."""
    return neighbourhood_sum(counts, ctx.params.radius).reshape(-1, 2)


def relocate(ctx, agents, near):
    ids, group = agents["id"], agents["group"].to(torch.int64)
    here = near[ctx.cell(agents)]                                    # [n, 2] counts around each agent
    same = here.gather(1, group[:, None]).squeeze(1).to(torch.int64) - 1   # minus the agent itself
    others = here.sum(1, dtype=torch.int64) - 1
    threshold = int(ctx.params.tolerance * (1 << 16))
    unhappy = (same << 16) < threshold * others                      # integers: exact on every rank
    new_x = ctx.randint(ids, ctx.grid[1], "move-x").to(torch.int16)
    new_y = ctx.randint(ids, ctx.grid[0], "move-y").to(torch.int16)
    agents["x"].copy_(torch.where(unhappy, new_x, agents["x"]))
    agents["y"].copy_(torch.where(unhappy, new_y, agents["y"]))
    return torch.stack([unhappy.sum(), same.sum(), others.sum()]).to(torch.int64)


MODEL = Model(
    name="schelling",
    fields={"id": torch.int32, "x": torch.int16, "y": torch.int16, "group": torch.uint8},
    params=SchellingParams,
    init=init,
    check=_check,
    substeps=[
        Substep("relocate", needs=("id", "x", "y", "group"), apply=relocate, moves=True,
                field="cell", channels=2, contribute=count_groups, prepare=neighbourhood,
                halo=lambda p: p.radius, series=["unhappy", "same", "neighbours"]),
    ],
)
