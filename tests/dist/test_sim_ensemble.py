"""Ensembles on 1, 2 and 3 real gloo ranks: every replicate's series, and every table made from them, bit for bit.

A replicate's seed is a function of (seed, point, replicate) only, so who runs it must not matter: whole
replicates on one rank each, a batch of them in one engine, or each split over every rank. The same holds
for the rounds of --until-ci (the same replicates are added on any rank count) and for a user's model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from multigpu.sim.config import SimConfig
from multigpu.sim.ensemble import run_ensemble
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

ENSEMBLES = {
    # a built-in spatial model, a sweep: waves of whole replicates per rank
    "sir": dict(model="sir", agents=600, grid=(12, 12), steps=12, params={"initial_infected": 0.05},
                ensemble={"replicates": 4, "sweep": ["params.beta=0.1,0.3"]}),
    # a user's model (pkg.module:MODEL)
    "rumour": dict(model="examples.sim_rumour:MODEL", agents=500, grid=(10, 10), steps=10,
                   ensemble={"replicates": 5}),
    # float series (the price), every replicate split over all ranks
    "market": dict(model="market", agents=700, steps=10, ensemble={"replicates": 3, "split": "agents"}),
    # rounds until the bands are narrow enough, on a contact network; replicates run in batches
    "network": dict(model="network_sir", agents=800, steps=15, network={"kind": "random", "contacts": 3},
                    params={"beta": 0.1, "initial_infected": 0.02},
                    ensemble={"replicates": 40, "min_replicates": 4, "until_ci": "95:0.3", "ci_series": ["I"],
                              "sweep": ["params.gamma=0.1,0.2"]}),
}


def _files(folder: Path) -> dict[str, bytes]:
    """Every replicate file and CSV table (not the timings, the plot, nor Parquet's metadata)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*.csv"))}


def _run_all(root: str) -> dict | None:
    out = {}
    for name, kwargs in ENSEMBLES.items():
        run_dir = Path(root) / name
        result = run_ensemble(SimConfig(plot=False, **kwargs), run_dir=run_dir, log=lambda line: None)
        if result is not None:
            out[name] = (_files(run_dir / "ensemble"), result.counts, result.summary["rounds"])
    return out or None


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    return _run_all(str(tmp_path_factory.mktemp("one")))


@pytest.mark.parametrize("world", [2, 3])
def test_every_replicate_and_table_is_the_same_on_any_rank_count(world, one_rank, tmp_path):
    got = run_on_ranks(_run_all, world, args=(str(tmp_path),), timeout_s=240)[0]
    for name, (files, counts, rounds) in one_rank.items():
        other, other_counts, other_rounds = got[name]
        assert sorted(other) == sorted(files), name
        for path, data in files.items():
            assert other[path] == data, f"{name}: {path} differs on {world} ranks"
        assert other_counts == counts and [r["replicates"] for r in other_rounds] == [r["replicates"] for r in rounds]
    sir_files, sir_counts, _ = one_rank["sir"]
    assert sir_counts == [4, 4] and sum(p.startswith("replicates/") for p in sir_files) == 8
    net_counts, net_rounds = one_rank["network"][1], one_rank["network"][2]
    assert len(net_rounds) > 1 and 4 < max(net_counts) <= 40, (net_counts, net_rounds)  # it added rounds, and stopped
