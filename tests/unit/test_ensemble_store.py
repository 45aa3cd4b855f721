"""An ensemble's folder is its state (:mod:`multigpu.sim.ensemble_store`): a replicate is a whole file or none, a
continued ensemble finds exactly the replicates on disk (and refuses a folder it cannot continue, in one line), a
folder of another run is brought over whole, and every replicate keeps its own seed. Pure file work, no engine:
before, only whole ensembles (tests/unit/test_sim_ensemble_resume.py, tests/dist, tests/cli) reached these rules,
and mutation testing found much of them unchecked."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from multigpu.errors import ConfigError
from multigpu.sim.config import SimConfig
from multigpu.sim.design import replicate_seed
from multigpu.sim.ensemble import _seed_of
from multigpu.sim.ensemble_store import ReplicateStore, check_folder, check_no_orphans, read_replicate

MANIFEST = {"points": [{"index": 0}, {"index": 1}], "seed": 7}
NAMES = ["S", "I"]
SHAPES = [(NAMES, 3), (NAMES, 3)]


def _series(k: float) -> dict[str, list]:
    return {"step": [1, 2, 3], "S": [10.0 - k, 9.0, 8.5], "I": [k, 1.0, 1.5]}


def _filled(root) -> ReplicateStore:
    store = ReplicateStore(root, MANIFEST)
    assert store.open() == {}
    for p, r in ((0, 0), (0, 1), (0, 3), (1, 0)):
        store.write(p, r, _series(p + r / 10))
    return store


def test_replicates_are_whole_files_read_back_as_written_in_replicate_order(tmp_path):
    root = tmp_path / "ensemble"
    store = _filled(root)
    assert json.loads((root / "manifest.json").read_text()) == {"format": 2, **MANIFEST}
    assert store.replicates(0) == [0, 1, 3] and store.replicates(1) == [0] and store.replicates(5) == []
    assert (root / "replicates" / "p000000" / "r000003.csv").read_text() == (
        "step,S,I\n1,9.7,0.3\n2,9.0,1.0\n3,8.5,1.5\n")
    assert store.read(0, 3).tolist() == [[9.7, 0.3], [9.0, 1.0], [8.5, 1.5]]
    names, values = read_replicate(root / "replicates" / "p000001" / "r000000.csv")
    assert names == NAMES and values.tolist() == store.read(1, 0).tolist() == [[9.0, 1.0], [9.0, 1.0], [8.5, 1.5]]
    assert [r for r, _ in store.iter_point(0)] == [0, 1, 3] and [r for r, _ in store.iter_point(0, upto=3)] == [0, 1]
    (root / "replicates" / "p000000" / "notes.txt").write_text("x")  # not a replicate's name: not one
    assert store.replicates(0) == [0, 1, 3]
    memory = ReplicateStore(None, MANIFEST)  # no run folder: the same, in memory, nothing written
    assert memory.open() == {}
    for p, r in ((0, 1), (0, 0), (1, 2)):
        memory.write(p, r, _series(r))
    assert memory.replicates(0) == [0, 1] and memory.replicates(1) == [2]
    assert np.array_equal(memory.read(0, 1), np.array([[9.0, 1.0], [9.0, 1.0], [8.5, 1.5]]))
    assert not list(tmp_path.glob("**/p000001"))[1:]  # only the folder's own point 1


def test_a_continued_ensemble_finds_what_is_on_disk_and_drops_what_a_kill_left_half_written(tmp_path):
    root = tmp_path / "ensemble"
    _filled(root)
    left = root / "replicates" / "p000000" / ".r000004.csv.tmp123"
    left.write_text("step,S,I\n1,")
    other = root / "replicates" / "p000000" / ".keep"
    other.write_text("")
    again = ReplicateStore(root, MANIFEST)
    assert again.open(root, SHAPES, most=4) == {0: [0, 1, 3], 1: [0]}
    assert not left.exists() and other.exists()  # only a replicate's temporary file is removed
    with pytest.raises(ConfigError, match="holds an ensemble already"):
        ReplicateStore(root, MANIFEST).open()
    with pytest.raises(ConfigError, match="another seed"):
        ReplicateStore(root, {**MANIFEST, "seed": 8}).open(root, SHAPES)  # another design: not continued
    with pytest.raises(ConfigError, match="is not an ensemble folder"):
        ReplicateStore(root, MANIFEST).open(tmp_path, SHAPES)


def test_another_runs_ensemble_is_brought_over_whole_and_left_as_it_was(tmp_path):
    theirs = tmp_path / "a" / "ensemble"
    _filled(theirs)
    before = {p.relative_to(theirs): p.read_bytes() for p in theirs.rglob("*") if p.is_file()}
    mine = tmp_path / "b" / "ensemble"
    mine.mkdir(parents=True)
    (mine / "replicates" / "p000000").mkdir(parents=True)
    (mine / "replicates" / "p000000" / "r000001.csv").write_text("mine\n")  # already here: kept
    store = ReplicateStore(mine, MANIFEST)
    assert store.open(theirs, SHAPES, most=4) == {0: [0, 1, 3], 1: [0]}
    assert (mine / "replicates" / "p000000" / "r000001.csv").read_text() == "mine\n"
    assert store.read(0, 3).tolist() == [[9.7, 0.3], [9.0, 1.0], [8.5, 1.5]] and store.replicates(1) == [0]
    assert json.loads((mine / "manifest.json").read_text()) == {"format": 2, **MANIFEST}
    assert not list(mine.rglob(".r*"))  # no temporary file left
    assert {p.relative_to(theirs): p.read_bytes() for p in theirs.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("damage, why", [
    (lambda f: f.write_text(f.read_text()[:-1]), "it is cut short: its last line has no end"),
    (lambda f: f.write_text(""), "it is empty"),
    (lambda f: f.write_text("step,S,X\n1,2,3\n2,2,3\n3,2,3\n"), "its columns are 'step,S,X', this ensemble's are "
                                                               "'step,S,I'"),
    (lambda f: f.write_text("step,S,I\n1,2,3\n2,2,3\n"), "it has 2 steps, this ensemble's replicates have 3"),
    (lambda f: f.write_text("step,S,I\n1,2\n2,2,3\n3,2,3\n"), "a row has more or fewer values than its columns"),
    (lambda f: f.write_bytes(b"\xff\xfe\n"), "it cannot be read: UnicodeDecodeError"),
])
def test_a_replicate_that_is_not_whole_is_named_and_nothing_is_continued(tmp_path, damage, why):
    root = tmp_path / "ensemble"
    _filled(root)
    damage(root / "replicates" / "p000000" / "r000001.csv")
    with pytest.raises(ConfigError) as info:
        check_folder(root, SHAPES)
    assert str(info.value) == (f"--resume: {root / 'replicates' / 'p000000' / 'r000001.csv'} is not a whole "
                               f"replicate of this ensemble ({why}); valid: delete that file (its replicate runs "
                               "again, with the same seed) and resume again, or a new --run-dir")


def test_a_point_or_replicate_this_run_does_not_ask_for_is_refused(tmp_path):
    root = tmp_path / "ensemble"
    _filled(root)
    (root / "replicates" / "p000000" / "a-note.txt").write_text("not a replicate: passed over, not the end")
    assert check_folder(root, SHAPES) == {0: [0, 1, 3], 1: [0]}
    assert check_folder(root, SHAPES, most=4) == {0: [0, 1, 3], 1: [0]}
    assert check_folder(tmp_path / "nothing", SHAPES) == {}
    with pytest.raises(ConfigError, match=r"holds 4 replicates of point 0 and sim.ensemble.replicates is 3 here"):
        check_folder(root, SHAPES, most=3)
    with pytest.raises(ConfigError, match=r"p000001 is not a point of this ensemble \(it has 1, p000000..p000000\)"):
        check_folder(root, SHAPES[:1])
    (root / "replicates" / "p01").mkdir()
    with pytest.raises(ConfigError, match="p01 is not a point of this ensemble"):
        check_folder(root, SHAPES)
    (root / "replicates" / "p01").rmdir()
    (root / "replicates" / "p000009").write_text("a file")
    with pytest.raises(ConfigError, match="p000009 is not a point of this ensemble"):
        check_folder(root, [(NAMES, 3)] * 10)


def test_replicate_files_without_a_manifest_are_neither_continued_nor_overwritten(tmp_path):
    root = tmp_path / "ensemble"
    _filled(root)
    (root / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="holds replicate files but no readable manifest.json"):
        check_no_orphans(root)
    with pytest.raises(ConfigError, match="holds replicate files but no readable manifest.json"):
        ReplicateStore(root, MANIFEST).open()
    for f in root.glob("replicates/p*/r*.csv"):
        f.rename(f.with_suffix(".old"))
    check_no_orphans(root)  # nothing a replicate's name: nothing to refuse


def test_every_replicate_has_its_own_seed_and_same_seeds_shares_them_across_points():
    cfg = SimConfig(model="sir", agents=100, grid=(4, 4), steps=2, seed=11,
                    ensemble={"replicates": 4, "sweep": ["params.beta=0.1,0.3"]})
    seed = _seed_of(cfg)
    assert seed(1, 3) == replicate_seed(11, 1, 3) and seed(0, 3) == replicate_seed(11, 0, 3)
    assert len({seed(p, r) for p in range(2) for r in range(4)}) == 8
    same = _seed_of(dataclasses.replace(cfg, ensemble=dataclasses.replace(cfg.ensemble, same_seeds=True)))
    assert [same(1, r) for r in range(4)] == [same(0, r) for r in range(4)] == [seed(0, r) for r in range(4)]


def test_bringing_another_runs_ensemble_into_a_fresh_folder_copies_where_it_cannot_link(tmp_path, monkeypatch):
    """A point with no replicate yet has no folder there; the destination has no replicates/ folder yet; across
    file systems (no hard link) each file is copied, whole (mutation testing: these paths were never run)."""
    import os

    manifest = {"points": [{"index": 0}, {"index": 1}, {"index": 2}], "seed": 7}
    theirs = tmp_path / "a" / "ensemble"
    store = ReplicateStore(theirs, manifest)
    store.open()
    store.write(0, 0, _series(0.5))
    store.write(2, 1, _series(2.5))

    def no_link(src, dst):
        raise OSError("Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    mine = tmp_path / "b" / "ensemble"
    mine.mkdir(parents=True)
    shapes = [(NAMES, 3)] * 3
    assert ReplicateStore(mine, manifest).open(theirs, shapes) == {0: [0], 1: [], 2: [1]}
    assert (mine / "replicates" / "p000002" / "r000001.csv").read_bytes() == \
        (theirs / "replicates" / "p000002" / "r000001.csv").read_bytes()
    assert not (mine / "replicates" / "p000001").exists() and not list(mine.rglob(".r*"))


def _book(cfg, root, source=None, said=None):
    """Rank 0's book of the ensemble in ``root``; ``source``: the folder it continues (``--resume PATH``, which
    the book decides from the run context by the ensemble's own rule)."""
    from multigpu.runtime.context import RunContext
    from multigpu.sim.ensemble import _Rank0, ensemble_points, point_configs, series_names

    points = ensemble_points(cfg)
    configs = point_configs(cfg, points)
    names = [series_names(c) for c in configs]
    ctx = RunContext(run_dir=str(root.parent), resume=str(source) if source is not None else None)
    return _Rank0(cfg, points, configs, names, root, ctx, (said if said is not None else []).append)


def _result(book, p: int, r: int) -> tuple[int, int, dict[str, list]]:
    steps = book.configs[p].steps
    return p, r, {"step": list(range(1, steps + 1)), **{n: [float(p + r + k) for k in range(steps)]
                                                         for n in book.names[p]}}


def test_rank_0_asks_for_each_replicate_once_in_replicate_order_and_a_continued_run_only_for_the_missing(tmp_path):
    """What an ensemble runs (rank 0's book, no engine): every point's first replicates first, each replicate
    once (a result that comes twice is not written or counted twice), and a continued ensemble asks only for the
    replicates not on disk, folding those that are."""
    cfg = SimConfig(model="sir", agents=100, grid=(4, 4), steps=2, plot=False,
                    ensemble={"replicates": 3, "sweep": ["params.beta=0.1,0.3"]})
    root = tmp_path / "run" / "ensemble"
    book = _book(cfg, root)
    items = book.next_items()
    assert items == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    book.take([_result(book, 1, 0), _result(book, 0, 0), _result(book, 0, 1)])
    before = (root / "replicates" / "p000000" / "r000000.csv").read_bytes()
    book.take([(0, 0, {**_result(book, 0, 0)[2], "step": [7, 8]})])  # the same replicate again: ignored
    assert (root / "replicates" / "p000000" / "r000000.csv").read_bytes() == before
    assert book.done == {0: {0, 1}, 1: {0}} and book.running[0].n == 2 and book.running[1].n == 1
    said: list[str] = []
    again = _book(cfg, root, source=root, said=said)  # killed here: continued
    assert again.done == {0: {0, 1}, 1: {0}} and said == [f"ensemble: continuing with the 3 replicates already in "
                                                          f"{root}"]
    assert again.next_items() == [(1, 1), (0, 2), (1, 2)]
    assert again.rounds == [{"round": 1, "replicates": 6, "kept": 3}] and again.running[0].n == 2
    again.take([_result(again, p, r) for p, r in [(1, 1), (0, 2), (1, 2)]])
    again.end_round(1.5)
    assert again.next_items() == [] and again.counts == [3, 3] and again.rounds[0]["seconds"] == 1.5
    assert sorted(again.store.replicates(0)) == [0, 1, 2] == sorted(again.store.replicates(1))


def test_a_continued_book_checks_the_files_against_this_run_and_folds_in_replicate_order(tmp_path, monkeypatch):
    """Mutation testing: rank 0's book passes the design's shapes and replicate count to the check of a continued
    folder; results are folded per point in replicate order, each once, whatever order they arrive in; the
    rounds are asked of next_counts with this run's figures, a point below its target gets only what it lacks,
    and a round found whole on disk takes no time."""
    from multigpu.sim import ensemble

    cfg = SimConfig(model="sir", agents=100, grid=(4, 4), steps=2, plot=False,
                    ensemble={"replicates": 3, "sweep": ["params.beta=0.1,0.3"]})
    root = tmp_path / "run" / "ensemble"
    book = _book(cfg, root)
    book.next_items()
    book.take([_result(book, 0, 2), _result(book, 0, 0), _result(book, 0, 0), _result(book, 1, 0)])
    book.take([_result(book, 1, 0), _result(book, 0, 1)])  # one seen already, one new: the new one is kept
    assert book.done == {0: {0, 1, 2}, 1: {0}}
    assert book.running[0].n == 3 and book.running[0].mean[:, 0].tolist() == [1.0, 2.0]  # replicates 0, 1, 2
    half = root / "replicates" / "p000000" / "r000001.csv"
    whole = half.read_text()
    half.write_text(whole[:-1])
    with pytest.raises(ConfigError, match="is not a whole replicate"):
        _book(cfg, root, source=root)
    half.write_text(whole)
    fewer = dataclasses.replace(cfg, ensemble=dataclasses.replace(cfg.ensemble, replicates=2))
    with pytest.raises(ConfigError, match="holds 3 replicates of point 0 and sim.ensemble.replicates is 2 here"):
        _book(fewer, root, source=root)
    calls = []

    def next_counts(done, widest, ci, most, first):
        calls.append((list(done), widest, ci, most, first))
        return [1, 2] if len(calls) == 1 else list(done)

    monkeypatch.setattr(ensemble, "next_counts", next_counts)
    other = _book(cfg, tmp_path / "other" / "ensemble")
    assert other.next_items() == [(0, 0), (1, 0), (1, 1)]  # point 0 asked for 1, point 1 for 2
    assert calls == [([0, 0], [None, None], None, 3, cfg.ensemble.min_replicates)]
    again = _book(cfg, root, source=root)  # point 0 has 0..2 on disk, point 1 has 0: the first round is kept
    calls.clear()
    monkeypatch.setattr(ensemble, "next_counts", lambda done, *a: [1, 1] if sum(done) == 0 else list(done))
    assert again.next_items() == [] and again.rounds == [{"round": 1, "replicates": 2, "kept": 2, "seconds": 0.0}]


def test_the_bands_watched_for_the_stopping_rule_are_this_runs(tmp_path):
    cfg = SimConfig(model="sir", agents=100, grid=(4, 4), steps=2, plot=False,
                    ensemble={"replicates": 6, "min_replicates": 2, "until_ci": "90:0.5", "ci_series": ["I"]})
    book = _book(cfg, tmp_path / "ensemble")
    names = book.names[0]
    assert book.ci == cfg.ensemble.ci and book.level == cfg.ensemble.band_level and book.ci.width == 0.5
    assert book.columns == [[names.index("I")]]
    everything = _book(dataclasses.replace(cfg, ensemble=dataclasses.replace(cfg.ensemble, ci_series=[])),
                       tmp_path / "b" / "ensemble")
    assert everything.columns == [list(range(len(names)))]
    assert book.widest() == [None] and _book(dataclasses.replace(cfg, ensemble=dataclasses.replace(
        cfg.ensemble, until_ci=None)), tmp_path / "c" / "ensemble").widest() == [None]


def test_each_round_is_asked_with_this_runs_stopping_rule(tmp_path, monkeypatch):
    from multigpu.sim import ensemble

    cfg = SimConfig(model="sir", agents=100, grid=(4, 4), steps=2, plot=False,
                    ensemble={"replicates": 6, "min_replicates": 3, "until_ci": "90:0.5"})
    calls = []
    monkeypatch.setattr(ensemble, "next_counts", lambda *args: calls.append(args) or [0])
    book = _book(cfg, tmp_path / "ensemble")
    assert book.next_items() == [] and calls == [([0], [None], cfg.ensemble.ci, 6, 3)]
