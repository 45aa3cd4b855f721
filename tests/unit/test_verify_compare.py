"""verify: results compared across world sizes (pure) and recorded by rank 0 only, atomically."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import multigpu as mg
from multigpu import verify
from multigpu.verify.compare import compare


def test_exact_by_default_and_tolerances_work_like_allclose():
    base = {"x": torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)}
    off = {"x": torch.tensor([1.0, 2.0, 4.0 + 1e-6], dtype=torch.float64)}
    (c,) = compare({1: base, 2: off})
    assert not c.passed and c.max_abs == pytest.approx(1e-6, rel=1e-3) and c.max_rel == pytest.approx(2.5e-7, rel=1e-3)
    assert compare({1: base, 2: off}, atol=1e-5)[0].passed
    assert compare({1: base, 2: off}, rtol=1e-6)[0].passed
    assert not compare({1: base, 2: off}, rtol=1e-8)[0].passed
    same = compare({1: base, 2: {"x": base["x"].clone()}, 3: {"x": base["x"].clone()}})
    assert [(c.world_size, c.baseline, c.passed, c.max_abs) for c in same] == [(2, 1, True, 0.0), (3, 1, True, 0.0)]


def test_mismatches_that_cannot_be_compared_number_by_number_fail_with_the_reason():
    results = {
        1: {"shape": torch.zeros(3), "dtype": torch.zeros(2), "only_one": torch.ones(1), "text": "a", "nan": torch.tensor([math.nan, 1.0])},
        3: {"shape": torch.zeros(4), "dtype": torch.zeros(2, dtype=torch.float64), "text": "b", "nan": torch.tensor([math.nan, 1.0])},
    }
    by_name = {c.name: c for c in compare(results)}
    assert "shape (4,) vs (3,)" in by_name["shape"].describe()
    assert "dtype torch.float64 vs torch.float32" in by_name["dtype"].problem
    assert by_name["only_one"].problem == "recorded at 1 ranks but not at 3"
    assert not by_name["text"].passed and "'b' vs 'a'" in by_name["text"].problem
    assert by_name["nan"].passed  # NaN in the same place on both sides is equal
    half_nan = compare({1: {"v": torch.tensor([1.0])}, 2: {"v": torch.tensor([math.nan])}})[0]
    assert not half_nan.passed and half_nan.max_abs == math.inf


def test_record_writes_on_rank_0_only_when_verify_dir_is_set(tmp_path, monkeypatch):
    monkeypatch.setattr(verify, "_RECORDED", set())
    mg.verify.record("skipped", 1.0)  # no verify folder in the run context: nothing written, script runs unchanged
    from multigpu.runtime import context

    context.set_current(context.RunContext(verify_dir=str(tmp_path)))
    mg.verify.record("loss", 0.25)
    mg.verify.record("out", torch.arange(4))
    mg.verify.record("labels", [[1, 2], [3, 4]])
    mg.verify.record("meta", {"k": "v"})
    saved = verify.load_results(tmp_path)
    assert sorted(saved) == ["labels", "loss", "meta", "out"]  # and no leftover temporary files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["labels.pt", "loss.pt", "meta.pt", "out.pt"]
    assert saved["loss"].item() == 0.25 and torch.equal(saved["out"], torch.arange(4))
    assert saved["labels"].shape == (2, 2) and saved["meta"] == {"k": "v"}
    with pytest.raises(ValueError, match="already called"):
        mg.verify.record("loss", 0.3)
    with pytest.raises(ValueError, match="letters, digits"):
        mg.verify.record("../escape", 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    mg.verify.record("not_rank0", 1.0)
    assert not (tmp_path / "not_rank0.pt").exists()


def test_lists_tuples_and_dicts_of_tensors_are_compared_item_by_item():
    """verify/compare.py once called bool(list == list) on lists of tensors ("Boolean value of Tensor ... is
    ambiguous") after both runs had finished: a record of ``[t1, t2]``, which the docstring allows."""
    base = {"pair": [torch.zeros(3), torch.ones(2)], "named": {"w": torch.ones(2), "n": (torch.tensor(1.0), 2)}}
    same = {"pair": [torch.zeros(3), torch.ones(2)], "named": {"w": torch.ones(2), "n": (torch.tensor(1.0), 2)}}
    assert all(c.passed for c in compare({1: base, 2: same}))
    off = {"pair": [torch.zeros(3), torch.ones(2) + 1e-7], "named": {"w": torch.ones(2), "n": (torch.tensor(1.0), 3)}}
    by_name = {c.name: c for c in compare({1: base, 2: off})}
    assert not by_name["pair"].passed and by_name["pair"].max_abs == pytest.approx(1.19e-7, rel=0.01)
    assert not by_name["named"].passed and by_name["named"].max_abs == 1.0
    assert {c.name: c.passed for c in compare({1: base, 2: off}, atol=1e-6)} == {"named": False, "pair": True}
    short = compare({1: base, 2: {"pair": [torch.zeros(3)], "named": {"w": torch.ones(2)}}})
    assert [c.problem for c in short] == ["keys ['w'] vs ['n', 'w']", "length 1 vs 2"]
    inner = compare({1: {"x": [torch.zeros(2)]}, 2: {"x": [torch.zeros(3)]}})[0]
    assert inner.problem == "[0]: shape (3,) vs (2,)"


def test_a_failure_within_float_noise_names_the_tolerance_that_would_pass():
    from multigpu.verify.compare import tolerance_hint

    base = {"loss": torch.tensor([2.5]), "w": torch.tensor([1.0, 4.0])}
    off = {"loss": torch.tensor([2.5 + 3.6e-7]), "w": torch.tensor([1.0, 4.0 + 4.8e-7])}
    failed = [c for c in compare({1: base, 2: off}) if not c.passed]
    hint = tolerance_hint(failed)
    atol, rtol = float(hint.split()[1]), float(hint.split()[-1])
    assert hint.startswith("--atol ") and " or --rtol " in hint
    assert all(c.passed for c in compare({1: base, 2: off}, atol=atol))
    assert all(c.passed for c in compare({1: base, 2: off}, rtol=rtol))
    assert not all(c.passed for c in compare({1: base, 2: off}, atol=atol / 2))
    assert tolerance_hint([c for c in compare({1: base, 2: {"loss": torch.zeros(2)}}) if not c.passed]) is None
    far = {"loss": torch.tensor([2.6]), "w": base["w"]}  # 4% off: a real difference, no tolerance offered
    assert tolerance_hint([c for c in compare({1: base, 2: far}) if not c.passed]) is None


def test_record_saves_nested_results_as_tensors_on_the_cpu(tmp_path):
    saved = verify._as_saved({"a": [torch.ones(2, requires_grad=True), 3], "b": (1.5, torch.tensor([1, 2]))})
    assert isinstance(saved["a"], list) and not saved["a"][0].requires_grad
    assert isinstance(saved["b"], tuple) and saved["b"][1].tolist() == [1, 2]
    verify._check_plain("nested", saved)


def test_the_verify_command_passes_within_atol_and_fails_beyond_it(capsys, tmp_path):
    """`multigpu verify --atol` through the command in-process, torch's launcher replaced: each run's rank 0 writes
    'mean' as mg.verify.record would, 0.25 off at 3 ranks. Exact by default it fails; with --atol 0.25 it passes; with less it still fails."""
    from unittest import mock

    from multigpu.cli import main
    from tests.conftest import run_file

    def launch(config, entrypoint, args):
        folder = Path(run_file()["run"]["verify_dir"])
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(torch.tensor(28.5 + (0.25 if config.nproc_per_node == 3 else 0.0), dtype=torch.float64),
                   folder / "mean.pt")

    def verify_cli(*flags: str) -> tuple[int, str, str]:
        with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=launch):
            code = main(["verify", "--nproc", "1,3", *flags, "examples/verify_dependent.py"])
        out, err = capsys.readouterr()
        return code, out, err.strip().splitlines()[-1]

    code, _, last = verify_cli()
    assert code == 1 and last == ("error: verify failed: 'mean' at 3 ranks vs 1: max abs difference 0.25, "
                                  "max rel difference 0.00877 (atol 0, rtol 0)")
    code, out, _ = verify_cli("--atol", "0.25")
    assert code == 0 and "verify passed: 1 result(s) equal at 1, 3 ranks (atol 0.25, rtol 0)" in out
    code, _, last = verify_cli("--atol", "0.2")
    assert code == 1 and "max abs difference 0.25, " in last and "(atol 0.2, rtol 0)" in last


def test_a_container_that_differs_fails_and_the_worst_item_is_kept():
    """Mutation testing: a problem inside a container fails the comparison (not only names it), a nested place
    reads ``[0][1]``, and the largest difference over the items is the one kept, whatever their order."""
    short = compare({1: {"k": {"a": 1}, "l": [1, 2]}, 2: {"k": {"b": 1}, "l": [1]}})
    assert [(c.name, c.passed) for c in short] == [("k", False), ("l", False)]
    nested = compare({1: {"x": [[1, "a"]]}, 2: {"x": [[1, 2]]}})[0]
    assert not nested.passed and nested.problem == "[0][1]: type int vs str"
    base = [torch.tensor([1.0]), torch.tensor([1.0]), torch.tensor([4.0])]
    for off in ([torch.tensor([1.5]), torch.tensor([1.25]), torch.tensor([4.0])],
                [torch.tensor([1.0]), torch.tensor([1.5]), torch.tensor([4.5])]):
        (c,) = compare({1: {"v": base}, 2: {"v": off}})
        assert (c.max_abs, c.max_rel) == (0.5, 0.5), off


def test_a_tolerance_is_rounded_up_and_zero_stays_zero():
    from multigpu.verify.compare import _round_up

    assert _round_up(0.0) == 0.0 and _round_up(-1.0) == 0.0
    assert _round_up(1.23e-7) == pytest.approx(1.3e-7) and _round_up(0.5) == pytest.approx(0.5)


def test_each_kind_of_leaf_is_compared_as_what_it_is():
    """Mutation testing: plain values, a tensor against a non-tensor, integer, bool, complex and empty tensors,
    and the relative difference of a difference of exactly 1."""
    by_name = {c.name: c for c in compare({
        1: {"s": "a", "n": 1, "t": torch.ones(1), "e": torch.zeros(0), "i": torch.tensor([3, 4]),
            "b": torch.tensor([True, False]), "c": torch.tensor([1 + 2j]), "one": torch.tensor([2.0]),
            "shape": torch.zeros(2), "dtype": torch.zeros(1)},
        2: {"s": "a", "n": "1", "t": "x", "e": torch.zeros(0), "i": torch.tensor([3, 6]),
            "b": torch.tensor([True, True]), "c": torch.tensor([1 + 1j]), "one": torch.tensor([3.0]),
            "shape": torch.zeros(3), "dtype": torch.zeros(1, dtype=torch.float64)}})}
    assert (by_name["s"].passed, by_name["s"].problem) == (True, None)
    assert (by_name["n"].passed, by_name["n"].problem) == (False, "type str vs int")
    assert (by_name["t"].passed, by_name["t"].problem) == (False, "type str vs Tensor")
    assert (by_name["e"].passed, by_name["e"].max_abs, by_name["e"].max_rel) == (True, 0.0, 0.0)
    assert (by_name["i"].passed, by_name["i"].max_abs, by_name["i"].max_rel) == (False, 2.0, 0.5)
    assert (by_name["b"].passed, by_name["b"].max_abs, by_name["b"].max_rel) == (False, 1.0, pytest.approx(1 / 2.2250738585072014e-308))
    assert not by_name["c"].passed and by_name["c"].max_abs == 1.0
    assert by_name["c"].max_rel == pytest.approx(1 / abs(1 + 2j))
    assert (by_name["one"].max_abs, by_name["one"].max_rel) == (1.0, 0.5)
    assert not by_name["shape"].passed and not by_name["dtype"].passed
    assert compare({1: {"i": torch.tensor([3, 4])}, 2: {"i": torch.tensor([3, 4])}})[0].passed


def test_a_result_missing_at_one_size_is_named_and_the_other_sizes_still_compared():
    results = {1: {"a": 1.0, "b": 2.0}, 2: {"b": 2.0}, 3: {"a": 1.0, "b": 2.0}, 4: {"b": 3.0}}
    got = [(c.name, c.world_size, c.baseline, c.passed, c.problem) for c in compare(results)]
    assert got == [("a", 2, 1, False, "recorded at 1 ranks but not at 2"), ("a", 3, 1, True, None),
                   ("a", 4, 1, False, "recorded at 1 ranks but not at 4"),
                   ("b", 2, 1, True, None), ("b", 3, 1, True, None), ("b", 4, 1, False, None)]
    only_later = compare({1: {}, 2: {"x": 1}})[0]
    assert (only_later.passed, only_later.problem) == (False, "recorded at 2 ranks but not at 1")


def test_complex_nan_in_the_same_place_is_equal_as_a_real_nan_is():
    """The module says NaN equals NaN: a complex NaN on both sides was infinitely far instead."""
    nan = complex(math.nan, 0.0)
    (c,) = compare({1: {"z": torch.tensor([nan, 1 + 1j])}, 2: {"z": torch.tensor([nan, 1 + 1j])}})
    assert c.passed and c.max_abs == 0.0
    (d,) = compare({1: {"z": torch.tensor([nan])}, 2: {"z": torch.tensor([1 + 1j])}})
    assert not d.passed and d.max_abs == math.inf
