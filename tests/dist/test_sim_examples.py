"""The two example models (examples/sim_schelling.py, examples/sim_opinion.py) are independent of the split.

They are written only against the public model API; each must give the same
agents (sorted by id) and the same aggregates on 1, 2 and 3 ranks with every
strategy. One spawn per world size runs every case.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.splitcheck import agents_on_rank0
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

SCHELLING = SimConfig(model="examples.sim_schelling:MODEL", agents=4001, grid=(21, 17), steps=8, chunk_size=1024,
                      rebalance_every=3, params={"tolerance": 0.6})
OPINION = SimConfig(model="examples.sim_opinion:MODEL", agents=3999, grid=(19, 23), steps=8, chunk_size=1024,
                    rebalance_every=2, params={"opinions": 4, "radius": 1, "p_update": 0.5})
CASES = {f"{name}-{strategy}": dataclasses.replace(cfg, strategy=strategy)
         for name, cfg in [("schelling", SCHELLING), ("schelling0", dataclasses.replace(SCHELLING, params={"radius": 0})),
                           ("opinion", OPINION)]
         for strategy in ("data", "spatial", "adaptive")}


def _run_cases():
    out = {}
    for name, cfg in CASES.items():
        engine = SimEngine(cfg)
        series = engine.run()
        out[name] = (agents_on_rank0(engine), series)
    return out if out[next(iter(out))][0] is not None else None


def test_examples_give_the_same_agents_on_one_two_and_three_ranks():
    ref = {}
    for name, cfg in CASES.items():
        engine = SimEngine(cfg)
        series = engine.run()
        ref[name] = (engine.state.sorted_by_id(), series)
    schelling = ref["schelling-data"][1]
    assert schelling["same"][-1] / schelling["neighbours"][-1] > schelling["same"][0] / schelling["neighbours"][0]
    assert sum(ref["opinion-data"][1][f"opinion{k}"][-1] for k in range(4)) == 3999
    for world in (2, 3):
        got = run_on_ranks(_run_cases, world, timeout_s=240)[0]
        for name in CASES:
            base = name.rsplit("-", 1)[0] + "-data"  # every strategy must match 1 rank's data strategy
            agents, series = got[name]
            assert series == ref[base][1], f"{world} ranks {name}: aggregates differ"
            for k, v in ref[base][0].items():
                assert torch.equal(agents[k], v), f"{world} ranks {name}: field {k} differs"
