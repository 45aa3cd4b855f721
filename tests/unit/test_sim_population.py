"""Populations from files and the final agents to files (one process; the ranks' version is in tests/dist).

Pins: every format reads back the agents it was given (row i is agent i);
fields without a column come from the model's init; bad files fail with one
line naming the file and the column; a save -> load round trip is exact.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.run import script_context
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
            result = mg.sim.run(cfg, script_context(tmp_path / "run"), return_agents=True)
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


def _with_state(agents, row: int, value: int) -> dict[str, np.ndarray]:
    state = agents["state"].copy()
    state[row] = value
    return {**agents, "state": state}


def test_a_state_the_model_does_not_have_is_refused_naming_the_row(tmp_path, agents):
    """state=1 (E) in plain SIR is refused naming the row: taken silently, S + I + R no longer summed to the agents."""
    path = tmp_path / "pop.npz"
    np.savez(path, **_with_state(agents, 2500, 1))
    expected = (f"sim.population '{path}': column 'state' holds 1 in row 2,500, a value model 'sir' does not use; "
                "valid: 0 (S), 2 (I), 3 (R)")
    with pytest.raises(ValueError) as err:  # the ranks (and mg.sim.run), for a run the launcher did not check
        SimEngine(dataclasses.replace(SIR, population=str(path)))
    assert str(err.value) == expected
    model = SimEngine(SIR, populate=False).model
    with pytest.raises(ConfigError) as err:  # the launcher's check, a chunk at a time
        population.check_values(path, model, model.params(), chunk=1000)
    assert str(err.value) == expected
    seir = model.params(seir=True)  # SEIR has E: the same file is valid there
    population.check_values(path, model, seir, chunk=1000)
    SimEngine(dataclasses.replace(SIR, population=str(path), params={"seir": True}, steps=1)).run()
    np.savez(path, **_with_state(agents, 7, 4))
    with pytest.raises(ConfigError, match=r"holds 4 in row 7, a value model 'sir' does not use; valid: 0 \(S\), "
                                          r"1 \(E\), 2 \(I\), 3 \(R\)"):
        population.check_values(path, model, seir)


# ----------------------------------------------------------------------------- never delete what we did not write
def _tree(root) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def small_engine():
    engine = SimEngine(dataclasses.replace(SIR, agents=500, steps=1))
    engine.run()
    return engine


@pytest.mark.parametrize("name", ["out", "out.npz"])
def test_saving_agents_into_a_folder_or_file_of_the_users_refuses_and_keeps_it(tmp_path, small_engine, name):
    target = tmp_path / name
    if name == "out":
        (target / "sub").mkdir(parents=True)
        (target / "thesis.txt").write_text("four years of work")
        (target / "sub" / "notes.md").write_text("more")
        (target / "x.npy").write_bytes(b"an agent-looking name beside them")
    else:
        target.write_text("not a zip: the user's own file named like an output")
    before = _tree(tmp_path)
    with pytest.raises(ConfigError) as info:
        population.save(small_engine, target)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"sim.save_agents {str(target)!r} ")
    assert ("holds files that are not agent files (sub/, thesis.txt)" in message if name == "out"
            else "holds something that is not a .npz agent table" in message), message
    assert "valid: a new path" in message
    assert _tree(tmp_path) == before  # nothing removed, nothing added (no temporary left)


def test_saving_agents_replaces_only_an_agent_table_and_leaves_other_temporaries_alone(tmp_path, small_engine):
    target = tmp_path / "agents"
    (tmp_path / "agents.tmp").write_text("the user's file with the name the old code used as its temporary")
    (tmp_path / "neighbour.txt").write_text("beside it")
    population.save(small_engine, target)
    first = _tree(target)
    assert sorted(first) == sorted(f"{k}.npy" for k in small_engine.state.schema)
    population.save(small_engine, target)  # our own folder: replaced
    assert _tree(target) == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agents", "agents.tmp", "neighbour.txt"]
    assert (tmp_path / "agents.tmp").read_text().startswith("the user's file")
    population.save(small_engine, tmp_path / "a.npz")
    population.save(small_engine, tmp_path / "a.npz")  # an .npz we wrote: replaced
    assert sorted(np.load(tmp_path / "a.npz").files) == sorted(small_engine.state.schema)
    assert oct((tmp_path / "a.npz").stat().st_mode & 0o777) != oct(0o600)  # the umask's mode, not mkstemp's


def test_a_run_directory_given_as_the_agents_folder_is_refused_before_the_job_starts(tmp_path, capsys, monkeypatch,
                                                                                     fake_gpus):
    from unittest import mock

    from multigpu.cli import main

    fake_gpus(0)
    tripwire = mock.Mock(side_effect=AssertionError("reached torch's launcher"))
    monkeypatch.setattr("multigpu.launch.agent._elastic_launch", tripwire)
    live = tmp_path / "runs" / "live"
    (live / "logs").mkdir(parents=True)
    (live / "run.json").write_text("{}")
    (live / ".lock").write_text("{}")
    before = _tree(tmp_path)
    code = main(["sim", "-f", "sir", "--agents", "1000", "--run-dir", str(tmp_path / "runs" / "new"),
                 "--save-agents", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert f"sim.save_agents {str(tmp_path / 'runs')!r} holds files that are not agent files (live/)" in err
    assert _tree(tmp_path) == before and not tripwire.called


# ----------------------------------------------------------------------------- bad values inside the file
def _cut_member(path, name: str, keep: int) -> None:
    """Rewrite ``path`` (an .npz) with member ``name`` cut to its first ``keep`` bytes (header intact)."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    members[name] = members[name][:keep]
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in members.items():
            zf.writestr(n, data)


@pytest.mark.parametrize("case", ["member shorter than its header", "object dtype", "npy shorter than its header"])
def test_bad_values_inside_a_population_file_are_one_line_naming_the_column(tmp_path, agents, case):
    """Before: ``The expanded size of the tensor (500) must match ...`` from deep in the engine, or numpy's pickle
    refusal; now the launcher's header check names the file, the column and what is valid."""
    if case == "member shorter than its header":
        path = tmp_path / "p.npz"
        np.savez(path, x=agents["x"], y=agents["y"])
        _cut_member(path, "y.npy", 128 + 2 * 500)  # 500 of 3001 int16 rows after the 128-byte header
        expected = "column 'y' declares 3,001 rows but holds 500 (1,128 of 6,130 bytes): the file is cut short"
    elif case == "object dtype":
        path = tmp_path / "p.npz"
        np.savez(path, x=agents["x"], y=np.array([str(v) for v in agents["y"]], dtype=object))
        expected = "column 'y' holds Python objects (dtype object), which would need unpickling"
    else:
        path = tmp_path / "p"
        _write("npy", path, {"x": agents["x"], "y": agents["y"]})
        data = (path / "x.npy").read_bytes()
        (path / "x.npy").write_bytes(data[: len(data) - 10])
        expected = "column 'x' declares 3,001 rows but holds 2,996"
    with pytest.raises(ConfigError) as info:
        population.columns(path, SimEngine(SIR, populate=False).model.fields)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"sim.population {str(path)!r}: ") and expected in message


@pytest.mark.fault
def test_two_writers_of_one_agents_folder_never_leave_a_reader_without_whole_files(tmp_path, small_engine,
                                                                                 monkeypatch):
    """issue 48: ``save_agents`` swapped the whole folder (old one renamed away, the new one renamed in): a second
    writer in between left readers without the folder (FileNotFoundError: 43k of 147k reads of two writers in a
    loop) and the first writer then failed on "Directory not empty". Each .npy is now put in place by a rename of
    its own: here writer B's whole save runs right after writer A's first rename, and a reader finds every file
    whole at each moment, both saves succeed, and what is left are whole agent files."""
    target = tmp_path / "agents"
    population.save(small_engine, target)  # the folder a reader is reading
    names = sorted(small_engine.state.schema)
    n = small_engine.num_agents

    def whole() -> list[str]:
        found = sorted(p.name for p in target.iterdir()) if target.is_dir() else []
        assert found == [f"{k}.npy" for k in names], found
        for k in names:
            assert np.load(target / f"{k}.npy").shape == (n,), k
        return found

    real, calls = os.replace, []

    def replace(src, dst, *args, **kwargs):
        real(src, dst, *args, **kwargs)
        calls.append(dst)
        if len(calls) == 1:  # writer A has made its first rename: writer B saves now, whole
            whole()
            population.save(small_engine, target)
            whole()

    monkeypatch.setattr(os, "replace", replace)
    population.save(small_engine, target)  # writer A
    monkeypatch.setattr(os, "replace", real)
    whole()
    assert (np.load(target / "id.npy") == np.arange(n)).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["agents"]  # no temporary of either writer left
