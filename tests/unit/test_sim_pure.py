"""Pure pieces of multigpu.sim: random numbers, partitions, agent records, config errors, one-process engine.

These pin the contracts split-independence rests on: random numbers are a
function of (seed, id, step, stream) only; partitions cover every row once;
packing agents for migration loses nothing; integer fields are exact.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multigpu.config import load_config
from multigpu.errors import ConfigError
from multigpu.sim import partition, rng
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.models import infection_table, pressure
from multigpu.sim.state import AgentState


def test_random_bits_match_the_reference_and_ignore_position():
    ids = torch.tensor([0, 1, 2, 7, 123456789, 2**31 - 1], dtype=torch.int32)
    for seed, step, stream in [(0, 0, 1), (5, -1, 10), (2**40, 99, 2)]:
        key = rng.step_key(seed, step, stream)
        bits = rng.random_bits(ids, key)
        assert bits.dtype == torch.int32
        assert bits.tolist() == [rng.reference_bits(int(i), key) for i in ids]
        # the same id gives the same bits wherever it sits in the tensor
        assert torch.equal(rng.random_bits(ids.flip(0), key), bits.flip(0))
    assert rng.step_key(0, 1, 1) != rng.step_key(0, 2, 1) != rng.step_key(1, 1, 1)
    assert rng.step_key(3, 4, 5) == rng.step_key(3, 4, 5)


def test_random_bits_are_roughly_uniform_and_thresholds_exact():
    ids = torch.arange(200_000, dtype=torch.int32)
    bits = rng.random_bits(ids, rng.step_key(1, 2, 3))
    u = rng.uniform(bits)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    hits = (rng.low_bits(bits, 24) < rng.threshold(0.3)).float().mean()
    assert abs(float(hits) - 0.3) < 0.005
    for k in range(32):  # every bit is about half ones
        assert abs(float(((bits >> k) & 1).float().mean()) - 0.5) < 0.01
    assert rng.threshold(0.0) == 0 and rng.threshold(1.0) == 1 << 24 and rng.threshold(2.0) == 1 << 24


@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(1, 8))
@settings(max_examples=200, deadline=None)
def test_balanced_borders_cover_every_row_once(counts, world):
    if world > len(counts):
        with pytest.raises(ValueError):
            partition.balanced_borders(counts, world)
        return
    b = partition.balanced_borders(counts, world)
    assert b[0] == 0 and b[-1] == len(counts) and len(b) == world + 1
    assert all(b[i] < b[i + 1] for i in range(world))  # at least one row each
    owner = partition.row_owner(b)
    assert owner.tolist() == sorted(owner.tolist()) and owner.numel() == len(counts)
    even = partition.even_borders(len(counts), world)
    per_rank = [sum(counts[b[r]:b[r + 1]]) for r in range(world)]
    # never worse than even strips by more than one row's worth
    assert max(per_rank) <= max(sum(counts[even[r]:even[r + 1]]) for r in range(world)) + max(counts)


def test_balanced_borders_follow_the_agents():
    assert partition.even_borders(10, 3) == [0, 4, 7, 10]
    assert partition.balanced_borders([9, 1, 1, 1, 1, 1, 1, 1, 1, 1], 3) == [0, 1, 4, 10]
    assert partition.balanced_borders([0, 0, 0, 10, 10, 0, 0, 0], 2) == [0, 4, 8]
    assert partition.imbalance([10, 10]) == 1.0 and partition.imbalance([15, 5]) == 1.5


def test_pack_unpack_and_remove_keep_every_agent():
    schema = {"id": torch.int32, "x": torch.int16, "y": torch.int16, "state": torch.uint8, "cash": torch.int64}
    s = AgentState(schema, 4)
    n = 50
    s.append({"id": torch.arange(n, dtype=torch.int32), "x": torch.arange(n, dtype=torch.int16) * 3,
              "y": -torch.arange(n, dtype=torch.int16), "state": (torch.arange(n) % 4).to(torch.uint8),
              "cash": torch.arange(n, dtype=torch.int64) * 10**12})
    assert s.bytes_per_agent == 17 and len(s) == n and s.capacity >= n
    idx = torch.tensor([0, 3, 48, 49, 20])
    records = s.pack(s.take(idx))
    assert records.shape == (5, 17) and records.dtype == torch.uint8
    back = s.unpack(records)
    for k in schema:
        assert torch.equal(back[k], s[k][idx])
    s.remove(torch.sort(idx).values)
    assert len(s) == n - 5
    assert sorted(s["id"].tolist()) == sorted(set(range(n)) - {0, 3, 48, 49, 20})
    assert torch.equal(s["cash"], s["id"].to(torch.int64) * 10**12)  # fields moved together
    assert s.pack(s.take(torch.zeros(0, dtype=torch.int64))).shape == (0, 17)


def test_infection_table_and_pressure():
    t = infection_table(0.05)
    assert t[0] == 0 and t[1] == rng.threshold(0.05) and t[-1] == 1 << 24
    assert bool((t[1:] >= t[:-1]).all())
    counts = torch.randint(0, 5, (6, 7), dtype=torch.int32)
    p = pressure(counts, 1)
    assert p.shape == (4, 7)
    for r in range(4):
        for c in range(7):
            want = sum(int(counts[r + dy, (c + dx) % 7]) for dy in range(3) for dx in (-1, 0, 1))
            assert int(p[r, c]) == want


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model=sri"], "sim.model 'sri' is not a known model; valid: market, movement, network_sir, sir"),
        (["agents=0"], "sim.agents=0 is invalid"),
        (["agnets=5"], "Did you mean 'sim.agents'"),
        (["params.bata=0.1"], "Did you mean 'sim.params.beta'"),
        (["substeps=[movement,infect]"], "unknown substep 'infect'"),
        (["strategy=diagonal"], "valid: data, spatial, adaptive"),
        (["model=market", "strategy=spatial"], "has no positions"),
        (["params.gamma=1.5"], "valid: a probability in [0, 1]"),
        (["grid=[10]"], "sim.grid=[10] is invalid"),
        (["model=market", "substeps=[movement]"], "needs agent fields"),
    ],
)
def test_config_errors_name_the_key_and_the_choices(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(SimConfig, None, overrides, prefix="sim")
    assert message in str(err.value)


def test_config_resolves_params_and_strategy_aliases():
    cfg = load_config(SimConfig, None, ["strategy=spatial_parallel", "params.beta=0.2"], prefix="sim")
    assert cfg.strategy == "spatial" and cfg.params["beta"] == 0.2 and cfg.params["gamma"] == 0.1
    assert cfg.substep_names == ("movement", "sir")
    with pytest.raises(ConfigError, match="fewer than the 4 ranks"):
        dataclasses.replace(cfg, grid=(3, 100)).check_world(4)


def _final(cfg: SimConfig):
    engine = SimEngine(cfg)
    series = engine.run()
    return engine.state.sorted_by_id(), series


def test_one_process_result_ignores_strategy_and_chunking():
    """At world size 1 the strategies and chunk sizes walk different code paths; the result must not move."""
    base = SimConfig(model="sir", agents=5000, grid=(30, 40), steps=12, chunk_size=4096,
                     params={"beta": 0.3, "radius": 1, "seir": True, "initial_infected": 0.02})
    ref_state, ref_series = _final(base)
    assert ref_series["step"] == list(range(1, 13))
    assert all(sum(ref_series[k][i] for k in "SEIR") == 5000 for i in range(12))
    assert ref_series["R"][-1] > 0 and ref_series["E"][-1] > 0
    for change in [dict(strategy="spatial"), dict(strategy="adaptive", rebalance_every=3), dict(chunk_size=1024)]:
        state, series = _final(dataclasses.replace(base, **change))
        assert series == ref_series, change
        for k in ref_state:
            assert torch.equal(state[k], ref_state[k]), (change, k)
    stale, _ = _final(dataclasses.replace(base, sync_frequency=4))  # documented approximation: it runs
    assert torch.equal(stale["id"], ref_state["id"])
    assert not torch.equal(stale["state"], ref_state["state"])  # stale fields do change the epidemic


@pytest.mark.slow
def test_compiled_kernels_give_the_same_agents():
    """torch.compile'd kernels (and the fused field kernel) must not change a single agent."""
    for cfg in [SimConfig(model="sir", agents=20_000, grid=(50, 40), steps=6, chunk_size=4096,
                          params={"beta": 0.3, "radius": 1, "seir": True, "initial_infected": 0.02}),
                SimConfig(model="market", agents=20_000, steps=6, chunk_size=4096)]:
        eager_state, eager_series = _final(cfg)
        state, series = _final(dataclasses.replace(cfg, compile=True))
        assert series == eager_series
        for k in eager_state:
            assert torch.equal(state[k], eager_state[k]), k


def test_tiles_cut_the_halo_of_a_square_grid_only_from_six_ranks():
    grid, r = (1000, 1000), 1
    assert partition.halo_cells(grid, 1, 1, r) == 0
    assert partition.halo_cells(grid, 2, 1, r) == 2 * 1000  # a strip: a row above and one below
    assert partition.halo_cells(grid, 2, 2, r) == 2 * 500 + 2 * 500 + 4  # 2 x 2: corners make it worse
    assert partition.halo_cells(grid, 2, 3, r) == 2 * 334 + 2 * 500 + 4
    for world in (1, 2, 3, 4, 5):
        assert partition.best_tiles(grid, world, r) == (world, 1), world
    assert partition.best_tiles(grid, 6, r) in ((2, 3), (3, 2))
    assert partition.best_tiles(grid, 9, r) == (3, 3)
    assert partition.halo_cells(grid, 3, 3, r) * 10 < partition.halo_cells(grid, 9, 1, r) * 7  # 1340 vs 2000
    assert partition.best_tiles((1000, 40), 4, r) == (4, 1)  # a tall grid keeps its row strips
    assert partition.best_tiles((40, 1000), 4, r) == (1, 4)  # a wide one is better cut into columns
