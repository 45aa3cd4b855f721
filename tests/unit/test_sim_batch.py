"""A batch of populations gives each replicate bit for bit the series of its own engine.

The batched network SIR (several replicates as one population, each with its own seed and graph) is a
second implementation of network_sir: these pin it to the engine's, for every generated graph kind, so an
ensemble's result never depends on whether its replicates ran batched.
"""

from __future__ import annotations

import dataclasses

import pytest

from multigpu.sim.batch import auto_batch, run_batch, supports
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine


@pytest.mark.parametrize("network", [{"kind": "random", "contacts": 3}, {"kind": "households", "household_size": 3},
                                     {"kind": "geometric", "radius": 0.04}])
def test_batched_network_sir_equals_one_engine_per_seed(network):
    cfg = SimConfig(model="network_sir", agents=900, steps=20, network=network,
                    params={"beta": 0.12, "gamma": 0.15, "initial_infected": 0.02})
    seeds = [3, 2**61 + 5, 0, 77]
    for seed, got in zip(seeds, run_batch(cfg, seeds), strict=True):
        want = SimEngine(dataclasses.replace(cfg, seed=seed)).run()
        assert got == want, (network["kind"], seed)
    assert max(got["R"]) > 0


def test_which_models_batch():
    net = SimConfig(model="network_sir", agents=1000, network={"kind": "random"})
    assert supports(net) and auto_batch(net) == 64 and auto_batch(dataclasses.replace(net, agents=10**6)) == 1
    assert not supports(SimConfig(model="sir")) and auto_batch(SimConfig(model="sir")) == 1


def test_the_batch_step_in_c_equals_the_torch_one(monkeypatch):
    """Where the C kernels build, a batch's whole step is one C call (native.net_batch_step); ``native=off`` runs
    the torch code: the series are the same."""
    from multigpu.sim import native

    if not native.available():
        pytest.skip("no C compiler: the torch code runs either way")
    calls = []
    real = native.net_batch_step
    monkeypatch.setattr(native, "net_batch_step", lambda *a: calls.append(1) or real(*a))
    cfg = SimConfig(model="network_sir", agents=700, steps=15, network={"kind": "random", "contacts": 4},
                    params={"beta": 0.1, "gamma": 0.15, "initial_infected": 0.03})
    seeds = [5, 6, 2**40 + 1]
    got = run_batch(cfg, seeds)
    assert len(calls) == cfg.steps
    assert got == run_batch(dataclasses.replace(cfg, native="off"), seeds) and max(got[0]["R"]) > 0
