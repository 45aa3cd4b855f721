"""Population files and saved agents on 3 ranks: each rank reads its own rows, and the saved table is the
one a single process writes (ordered by id, whatever the split), in every format."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import multigpu as mg
from multigpu.run import script_context
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.runner import run
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

SIR = SimConfig(model="sir", agents=4003, grid=(31, 19), steps=5, chunk_size=1024, plot=False,
                params={"beta": 0.3, "radius": 1})


def _formats():
    try:
        import pyarrow  # noqa: F401

        return ("out.npz", "out_dir", "out.parquet")
    except ImportError:
        return ("out.npz", "out_dir")


def _run(pop: str, run_dir: str):
    out = {}
    for strategy, target in zip(("data", "spatial", "adaptive"), _formats(), strict=False):
        cfg = dataclasses.replace(SIR, population=pop, strategy=strategy, save_agents=target, rebalance_every=2)
        result = run(cfg, script_context(f"{run_dir}/{strategy}"), return_agents=True)
        out[strategy] = (str(result.agents_path) if mg.is_main() else None, result.agents)
    return out


def _table(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".npz"):
        z = np.load(path)
        return {k: z[k] for k in z.files}
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        t = pq.read_table(path)
        return {k: t.column(k).to_numpy() for k in t.column_names}
    from pathlib import Path

    return {p.stem: np.load(p) for p in Path(path).glob("*.npy")}


def test_three_ranks_read_a_population_and_save_what_one_process_computes(tmp_path):
    start = SimEngine(dataclasses.replace(SIR, steps=3))
    start.run()
    pop = tmp_path / "pop.npz"
    np.savez(pop, **{k: v.numpy() for k, v in start.state.sorted_by_id().items() if k != "id"})
    ref = SimEngine(dataclasses.replace(SIR, population=str(pop)))
    ref.run()
    want = {k: v.numpy() for k, v in ref.state.sorted_by_id().items()}

    results = run_on_ranks(_run, 3, args=(str(pop), str(tmp_path / "run")), timeout_s=240)
    for strategy, (path, _) in results[0].items():
        got = _table(path)
        assert set(got) == set(want), strategy
        for k in want:
            assert np.array_equal(got[k], want[k]) and got[k].dtype == want[k].dtype, (strategy, path, k)
    # return_agents: each rank its own agents; together every agent once
    ids = np.concatenate([r["data"][1]["id"].numpy() for r in results])
    assert np.array_equal(np.sort(ids), np.arange(4003))
