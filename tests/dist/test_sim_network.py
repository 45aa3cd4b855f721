"""SIR on a contact network: split-independent on 1, 2 and 3 ranks, and equal to a plain single-process
reference written here (loops over an adjacency list, the random numbers from ``rng.reference_bits``).

The file graph has repeated edges and self-loops on purpose (a repeated edge counts twice, a self-loop
never). The generated graphs (households, geometric) must come out the same whatever the split: the
final agents and series on 2 and 3 ranks equal one process's.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from multigpu.sim import exchange, network, rng
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.splitcheck import agents_on_rank0
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

N, STEPS, SEED = 400, 15, 3
PARAMS = {"beta": 0.2, "gamma": 0.1, "initial_infected": 0.03}


def _edges() -> np.ndarray:
    r = random.Random(7)
    edges = [(r.randrange(N), r.randrange(N)) for _ in range(1200)]
    edges += edges[:50] + [(5, 5), (6, 6)]  # repeated edges and self-loops
    return np.array(edges, dtype=np.int64)


def _reference(edges: np.ndarray) -> tuple[list[int], dict[str, list[int]]]:
    """SIR on the graph, one agent at a time, in plain Python."""
    S, I, R = 0, 2, 3  # noqa: E741 - the engine's state codes

    def u24(agent: int, key: int) -> int:
        return (rng.reference_bits(agent, key) >> 8) & 0xFFFFFF

    neighbours = [[] for _ in range(N)]
    for a, b in edges.tolist():
        if a != b:
            neighbours[a].append(b)
            neighbours[b].append(a)
    init_key = rng.step_key(SEED, -1, 12)
    state = [I if u24(i, init_key) < rng.threshold(PARAMS["initial_infected"]) else S for i in range(N)]
    series = {"S": [], "I": [], "R": []}
    for step in range(STEPS):
        key = rng.step_key(SEED, step, rng.STREAM_TRANSITION)
        infected_near = [sum(state[j] == I for j in neighbours[i]) for i in range(N)]
        new = []
        for i in range(N):
            u = u24(i, key)
            if state[i] == S:
                hit = u < rng.threshold(1.0 - (1.0 - PARAMS["beta"]) ** infected_near[i])
                new.append(I if hit else S)
            elif state[i] == I:
                new.append(R if u < rng.threshold(PARAMS["gamma"]) else I)
            else:
                new.append(state[i])
        state = new
        for name, code in (("S", S), ("I", I), ("R", R)):
            series[name].append(state.count(code))
    return state, series


def _configs(edge_file: str) -> dict[str, SimConfig]:
    base = dict(model="network_sir", agents=N, steps=STEPS, seed=SEED, params=PARAMS, chunk_size=1024)
    return {
        "file": SimConfig(**base, network={"kind": "file", "path": edge_file}),
        "households": SimConfig(**{**base, "agents": 3001}, network={"kind": "households", "household_size": 3,
                                                                    "contacts": 2}),
        "geometric": SimConfig(**{**base, "agents": 3001}, network={"kind": "geometric", "radius": 0.04}),
    }


def _run(edge_file: str):
    out = {}
    for name, cfg in _configs(edge_file).items():
        engine = SimEngine(cfg)
        series = engine.run()
        degree_sum = exchange.sum_field(network.degrees(engine.graph).sum().reshape(1))  # all ranks' edges
        out[name] = (agents_on_rank0(engine), series, int(degree_sum))
    return out


def test_network_sir_matches_the_reference_and_ignores_the_split(tmp_path):
    edges = _edges()
    path = tmp_path / "edges.npz"
    np.savez(path, src=edges[:, 0], dst=edges[:, 1])
    state, series = _reference(edges)
    one = _run(str(path))
    agents, got_series, degree_sum = one["file"]
    assert agents["state"].tolist() == state
    assert {k: got_series[k] for k in ("S", "I", "R")} == series
    assert degree_sum == 2 * int((edges[:, 0] != edges[:, 1]).sum())
    assert series["R"][-1] > 0 and one["geometric"][2] > 3001 and one["households"][2] > 3001
    for world in (2, 3):
        ranks = run_on_ranks(_run, world, args=(str(path),), timeout_s=240)[0]
        for name, (want_agents, want_series, want_degrees) in one.items():
            got_agents, got, degrees = ranks[name]
            assert got == want_series, f"{name} on {world} ranks: series differ"
            assert degrees == want_degrees, f"{name} on {world} ranks: the graph differs"
            for k, v in want_agents.items():
                assert torch.equal(got_agents[k], v), f"{name} on {world} ranks: field {k} differs"
