"""Populations from files and the final agents to files (one process; the ranks' version is in tests/dist).

Pins: every format reads back the agents it was given (row i is agent i);
fields without a column come from the model's init; bad files fail with one
line naming the file and the column; a save -> load round trip is exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.sim import population
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine

SIR = SimConfig(model="sir", agents=3001, grid=(30, 20), steps=4, chunk_size=1024, params={"beta": 0.3}, plot=False)


@pytest.fixture(scope="module")
def agents():
    engine = SimEngine(SIR)
    engine.run()
    return {k: v.numpy() for k, v in engine.state.sorted_by_id().items()}


def _write(kind: str, path, table: dict[str, np.ndarray]):
    if kind == "npz":
        np.savez(path, **table)
    elif kind == "npy":
        path.mkdir()
        for k, v in table.items():
            np.save(path / f"{k}.npy", v)
    elif kind == "csv":
        names = list(table)
        lines = [",".join(names)] + [",".join(str(table[k][i]) for k in names) for i in range(len(table[names[0]]))]
        path.write_text("\n".join(lines) + "\n")
    else:
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        t = pa.table(table)
        pq.write_table(t, path, row_group_size=700)  # several row groups: reads must cross them


@pytest.mark.parametrize("kind, name", [("npz", "p.npz"), ("npy", "p"), ("csv", "p.csv"), ("parquet", "p.parquet")])
def test_every_format_gives_back_the_agents_it_holds(tmp_path, agents, kind, name):
    path = tmp_path / name
    table = {k: v for k, v in agents.items() if k != "id"} if kind == "csv" else agents  # no id column: row = id
    _write(kind, path, table)
    assert population.columns(path, SimEngine(SIR, populate=False).model.fields)[0] == 3001
    for strategy in ("data", "spatial"):
        engine = SimEngine(dataclasses.replace(SIR, population=str(path), steps=0, strategy=strategy, agents=7))
        assert engine.num_agents == 3001
        got = engine.state.sorted_by_id()
        for k, v in agents.items():
            assert np.array_equal(got[k].numpy(), v), (kind, strategy, k)
    # chunked reads cross chunk (and row-group) borders
    rows = list(population.read_rows(path, {"x": torch.int16, "y": torch.int16}, 100, 2900, 333))
    assert [r[0] for r in rows] == list(range(100, 2900, 333))
    assert np.array_equal(torch.cat([r[1]["x"] for r in rows]).numpy(), agents["x"][100:2900])


def test_missing_fields_come_from_init_and_saves_round_trip(tmp_path, agents):
    np.savez(tmp_path / "xy.npz", x=agents["x"], y=agents["y"])  # no state: init draws it per id
    engine = SimEngine(dataclasses.replace(SIR, population=str(tmp_path / "xy.npz"), steps=0))
    fresh = SimEngine(dataclasses.replace(SIR, steps=0)).state.sorted_by_id()
    assert torch.equal(engine.state.sorted_by_id()["state"], fresh["state"])
    assert np.array_equal(engine.state.sorted_by_id()["x"].numpy(), agents["x"])

    import multigpu as mg

    mg.init(backend="cpu")
    try:
        for target in ("out.npz", "out_dir", "out.parquet"):
            if target.endswith(".parquet"):
                pytest.importorskip("pyarrow")
            cfg = dataclasses.replace(SIR, population=str(tmp_path / "xy.npz"), save_agents=target)
            result = mg.sim.run(cfg, run_dir=tmp_path / "run", progress=False, return_agents=True)
            assert result.agents_path == tmp_path / "run" / target
            back = SimEngine(dataclasses.replace(SIR, population=str(result.agents_path), steps=0))
            for k, v in back.state.sorted_by_id().items():
                assert torch.equal(v, result.agents[k]), (target, k)
    finally:
        mg.shutdown()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p, a: np.savez(p, x=a["x"], y=a["y"], stat=a["state"]), "column(s) ['stat'] are not fields"),
        (lambda p, a: np.savez(p, x=a["x"], y=a["y"][:10]), "columns differ in length"),
        (lambda p, a: np.savez(p, x=a["x"].astype(np.float32), y=a["y"]), "holds floats (float32)"),
        (lambda p, a: np.savez(p, x=a["x"].reshape(-1, 1), y=a["y"]), "has shape (3001, 1)"),
        (lambda p, a: p.write_bytes(b"not a zip"), "cannot be read as npz"),
    ],
)
def test_bad_population_files_are_one_line_config_errors(tmp_path, agents, make, message):
    path = tmp_path / "bad.npz"
    make(path, agents)
    with pytest.raises(ConfigError) as err:
        SimEngine(dataclasses.replace(SIR, population=str(path)))
    assert message in str(err.value) and str(path) in str(err.value)


def test_bad_population_values_name_the_rows(tmp_path, agents):
    cases = [
        ({**agents, "id": agents["id"][::-1].copy()}, "is not the row number"),
        ({**agents, "x": agents["x"] + 100}, "column 'x' has values outside the grid"),
        ({**agents, "state": agents["state"].astype(np.int64) + 300}, "column 'state' has values outside uint8"),
    ]
    for table, message in cases:
        np.savez(tmp_path / "bad.npz", **table)
        with pytest.raises(ValueError, match=None) as err:
            SimEngine(dataclasses.replace(SIR, population=str(tmp_path / "bad.npz")))
        assert message in str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        SimEngine(dataclasses.replace(SIR, population=str(tmp_path / "nope.npz")))
    with pytest.raises(ConfigError, match="a single .npy is one field"):
        SimEngine(dataclasses.replace(SIR, population=str(tmp_path / "x.npy")))
