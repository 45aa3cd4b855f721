"""Opinion dynamics (a voter model on a grid), written only against the public model API (:mod:`multigpu.sim.api`).

Agents hold one of ``opinions`` opinions and walk at random on a periodic
grid (the built-in ``movement`` substep). Each step, with probability
``p_update`` an agent listens to one agent picked uniformly among those in
its cell (``radius: 0``) or 3x3 neighbourhood (``radius: 1``), itself
included, and adopts that agent's opinion; with probability ``p_noise`` it
takes a random opinion instead. Local consensus spreads into domains;
``series.csv`` has the number of agents per opinion.

    multigpu sim --model examples.sim_opinion:MODEL --agents 1_000_000 grid=[400,400] --steps 100 \\
        --nproc-per-node 2 --strategy adaptive params.opinions=4
    multigpu sim --model examples.sim_opinion:MODEL --check-split

Split-independent because the per-cell opinion counts are integers summed
over ranks (a "cell" field with one channel per opinion), and the pick is an
integer: the agent's own random number in [0, neighbours) located among the
cumulative counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from multigpu.errors import ConfigError
from multigpu.sim import Model, Substep, neighbourhood_sum, spawn_on_grid


@dataclass(frozen=True, kw_only=True)
class OpinionParams:
    opinions: int = 3
    """Number of opinions (2..32)."""
    p_update: float = 0.3
    """Probability per step that an agent listens to a neighbour."""
    p_noise: float = 0.001
    """Probability per step that an agent takes a random opinion instead."""
    move_prob: float = 0.5
    """Probability per step of a random-walk move (read by the built-in movement substep)."""
    radius: int = 0
    """Neighbourhood: 0 = the agent's cell, 1 = the 3x3 cells around it."""


def _check(p: OpinionParams) -> None:
    if not 2 <= p.opinions <= 32:
        raise ConfigError(f"sim.params.opinions={p.opinions} is invalid; valid: 2..32")
    for name in ("p_update", "p_noise", "move_prob"):
        if not 0.0 <= getattr(p, name) <= 1.0:
            raise ConfigError(f"sim.params.{name}={getattr(p, name)} is invalid; valid: a probability in [0, 1]")
    if p.radius not in (0, 1):
        raise ConfigError(f"sim.params.radius={p.radius} is invalid; valid: 0 or 1")


def init(ctx, ids):
    agents = spawn_on_grid(ids, ctx.seed, ctx.grid)
    agents["opinion"] = ctx.randint(ids, ctx.params.opinions, "initial-opinion").to(torch.uint8)
    return agents


def count_opinions(ctx, agents, acc):
    """acc[cell, opinion] += 1; ctx.cell sends agents outside this rank's rows (about to migrate) to the drop row."""
    cell = ctx.cell(agents)
    acc.index_put_((cell, agents["opinion"].to(torch.int64)),
                   torch.ones_like(cell, dtype=acc.dtype), accumulate=True)


def cumulative(ctx, counts):
    """Per local cell, the running sum of opinion counts within the radius: [cells, opinions] int64."""
    near = neighbourhood_sum(counts, ctx.params.radius).reshape(-1, ctx.params.opinions)
    return near.to(torch.int64).cumsum(1)


def adopt(ctx, agents, cum):
    ids, p = agents["id"], ctx.params
    mine = cum[ctx.cell(agents)]                                      # [n, opinions]
    pick = ctx.randint(ids, mine[:, -1], "pick")                      # in [0, neighbours)
    heard = (mine <= pick[:, None]).sum(1)                            # first opinion whose running count > pick
    listens = ctx.bernoulli(ids, p.p_update, "listen")
    noisy = ctx.bernoulli(ids, p.p_noise, "noise")
    random_opinion = ctx.randint(ids, p.opinions, "random-opinion")
    new = torch.where(noisy, random_opinion, torch.where(listens, heard, agents["opinion"].to(torch.int64)))
    agents["opinion"].copy_(new.to(torch.uint8))
    return torch.bincount(new, minlength=p.opinions)[: p.opinions].to(torch.int64)


MODEL = Model(
    name="opinion",
    fields={"id": torch.int32, "x": torch.int16, "y": torch.int16, "opinion": torch.uint8},
    params=OpinionParams,
    init=init,
    check=_check,
    substeps=[
        "movement",  # the built-in random walk (reads params.move_prob)
        Substep("adopt", needs=("id", "x", "y", "opinion"), apply=adopt, field="cell",
                channels=lambda p: p.opinions, contribute=count_opinions, prepare=cumulative,
                halo=lambda p: p.radius, series=lambda p: [f"opinion{k}" for k in range(p.opinions)]),
    ],
)
