"""The rules a model must follow on the spatial strategies, each broken by a small model on 2 real ranks.

Before these rules were enforced, breaking them showed as a raw IndexError in
the user's own function (``index 3551 is out of bounds for dimension 0 with
size 1800``). Now each is one line naming the substep and the rule:

* ``WALK`` changes ``y`` in a substep without ``moves=True``;
* ``OFFGRID`` moves agents (``moves=True``) off the grid instead of wrapping them;
* ``DROP`` adds agents that just left this rank's rows into the cell field at
  their raw index instead of the drop slot;
* ``SHAPES`` follows the rules: ``contribute`` uses ``ctx.cell`` (which sends
  agents outside the rows to the drop slot), ``prepare`` gets
  ``[rows + 2 * halo, width, channels]`` and sums it with the public
  ``neighbourhood_sum``; 2 ranks give 1 rank's agents.

Both ranks break a rule in the same substep (agents cross both borders of
both strips), before any collective, so one spawn runs every case.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.sim import Model, Substep, neighbourhood_sum, spawn_on_grid
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.models import MovementParams  # the built-in movement substep reads params.move_prob
from multigpu.sim.splitcheck import agents_on_rank0
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

FIELDS = {"id": torch.int32, "x": torch.int16, "y": torch.int16, "heard": torch.int32}


def _init(ctx, ids):
    return {**spawn_on_grid(ids, ctx.seed, ctx.grid), "heard": torch.zeros_like(ids)}


def _walk(ctx, agents, _):
    # WRONG on purpose: changes y, but the substep is not marked moves=True
    agents["y"].copy_((agents["y"] + 1) % ctx.grid[0])


def _jump(ctx, agents, _):
    # WRONG on purpose: marked moves=True, but the new rows are not wrapped onto the grid
    agents["y"].add_(100)


def _raw_count(ctx, agents, acc):
    # WRONG on purpose: the raw cell index, not the drop slot, for agents that just left this rank's rows
    cell = (agents["y"].to(torch.int64) - ctx.lo) * ctx.grid[1] + agents["x"].to(torch.int64)
    acc.index_add_(0, cell, torch.ones_like(cell, dtype=acc.dtype))


def _count(ctx, agents, acc):
    cell = ctx.cell(agents)
    acc.index_put_((cell, agents["id"].to(torch.int64) % 2), torch.ones_like(cell, dtype=acc.dtype), accumulate=True)


def _near(ctx, counts):
    shapes = ctx.env.setdefault("shapes", [])
    shapes.append((tuple(counts.shape), ctx.rows))
    return neighbourhood_sum(counts, 1).reshape(-1, 2)


def _listen(ctx, agents, near):
    agents["heard"] += near[ctx.cell(agents)][:, 0]
    return agents["heard"].sum(dtype=torch.int64).reshape(1)


def _noop(ctx, agents, prepared):
    return None


WALK = Model(name="walk-not-marked", fields=FIELDS, init=_init, substeps=[Substep("walk", apply=_walk)])
OFFGRID = Model(name="off-the-grid", fields=FIELDS, init=_init, substeps=[Substep("jump", apply=_jump, moves=True)])
DROP = Model(name="no-drop-slot", fields=FIELDS, init=_init, params=MovementParams,
             substeps=["movement", Substep("count", apply=_noop, field="cell", contribute=_raw_count)])
SHAPES = Model(name="halo-shapes", fields=FIELDS, init=_init, params=MovementParams,
               substeps=["movement", Substep("listen", apply=_listen, field="cell", channels=2, halo=1,
                                             contribute=_count, prepare=_near, series=["heard"])])

CASES = {name: SimConfig(model=f"tests.dist.test_sim_rules:{name}", agents=4000, grid=(24, 20), steps=4,
                         chunk_size=1024, strategy="spatial", plot=False) for name in ("WALK", "OFFGRID", "DROP", "SHAPES")}


def _run_cases():
    out = {}
    for name, cfg in CASES.items():
        try:
            engine = SimEngine(cfg)
            series = engine.run()
        except ConfigError as exc:
            out[name] = str(exc)
            continue
        out[name] = (agents_on_rank0(engine), series, engine.ctx.env["shapes"][0], engine.borders)
    return out


def test_each_broken_rule_is_one_line_naming_the_substep_and_the_rule_on_two_ranks():
    ref = SimEngine(dataclasses.replace(CASES["SHAPES"], strategy="data"))
    want = ref.run()
    assert ref.ctx.env["shapes"][0] == ((24 + 2, 20, 2), 24)
    for rank, got in enumerate(run_on_ranks(_run_cases, 2, timeout_s=240)):
        walk, drop, jump = got["WALK"], got["DROP"], got["OFFGRID"]
        assert jump.startswith("substep 'jump' moved agent id ") and "off the grid" in jump, jump
        assert "valid: 0 <= x < 20, 0 <= y < 24); wrap positions" in jump, jump
        assert walk.startswith("substep 'walk' moved agents but is not marked moves=True (agent id "), walk
        assert "outside this rank's rows" in walk and "\n" not in walk, walk
        assert drop.startswith("substep 'count': contribute indexed outside its field (index out of range"), drop
        assert "the drop slot acc[-1]; ctx.cell(agents) does that" in drop and "\n" not in drop, drop
        agents, series, shape, borders = got["SHAPES"]
        rows = borders[rank + 1] - borders[rank]
        assert shape == ((rows + 2, 20, 2), rows), shape  # this rank's rows, one halo row each side, channels
        assert series == want, "the halo model differs on 2 ranks"
        if rank == 0:
            assert all(torch.equal(agents[k], v) for k, v in ref.state.sorted_by_id().items())
