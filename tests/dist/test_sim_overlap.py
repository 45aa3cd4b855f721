"""Overlapped communication changes nothing: the same agents and aggregates with ``overlap: on`` as with the
synchronous path, on 2 gloo ranks, with the C kernels and with the torch kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import multigpu as mg
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

SIR = SimConfig(model="sir", agents=5003, grid=(21, 17), steps=9, chunk_size=1024, rebalance_every=3, log_every=2,
                sort_every=4, params={"beta": 0.3, "radius": 1, "seir": True, "initial_infected": 0.02,
                                      "move_prob": 0.7})
CASES = {f"{strategy}-{overlap}-{native}": dataclasses.replace(SIR, strategy=strategy, overlap=overlap, native=native)
         for strategy in ("spatial", "adaptive", "data") for overlap in ("on", "off") for native in ("auto", "off")}


def _run():
    out = {}
    for name, cfg in CASES.items():
        engine = SimEngine(cfg)
        series = engine.run()
        parts = {k: mg.gather(engine.state[k].to(torch.int64)) for k in engine.state.schema}
        if mg.is_main():
            order = torch.argsort(parts["id"])
            out[name] = (series, {k: v[order] for k, v in parts.items()})
    return out if mg.is_main() else None


def test_overlap_on_and_off_give_the_agents_of_one_rank():
    engine = SimEngine(dataclasses.replace(SIR, native="off"))  # one rank, torch kernels: the reference
    ref_series = engine.run()
    ref = {k: v.to(torch.int64) for k, v in engine.state.sorted_by_id().items()}
    got = run_on_ranks(_run, 2, timeout_s=120)[0]
    assert set(got) == set(CASES)
    for name, (series, agents) in got.items():
        assert series == ref_series, f"{name}: aggregates differ"
        for k in ref:
            assert torch.equal(agents[k], ref[k]), f"{name}: field {k} differs"
    assert any(m > 0 for m in ref_series["moved"])
