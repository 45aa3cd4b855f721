"""A resume at another world size is checked by comparing the state's fingerprint (train, FSDP) or digest (sim, rl)
with the one saved: each check must be able to fail. Before these, a ``compare()`` that always said equal and a
``fingerprint()`` of zeros both passed every test (the elastic e2e test reads only ``equal``/``bit_exact``, which a
constant fingerprint satisfies)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from multigpu.checkpoint import resize
from multigpu.testing.fakecuda import fake_group


def test_fingerprint_is_the_sum_and_sum_of_squares_of_each_parts_tensors():
    """Per part: float and int32/int64 tensors counted, nested in dicts, lists and tuples; other dtypes skipped."""
    parts = {
        "model": {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([[-3.0]], dtype=torch.float16)},
        "optimizer": [torch.tensor([4], dtype=torch.int64), (torch.tensor([5, -6], dtype=torch.int32),),
                      torch.tensor([True]), torch.tensor([7], dtype=torch.uint8), "not a tensor", None],
        "empty": {},
    }
    got = resize.fingerprint(parts)
    assert list(got) == ["empty", "model", "optimizer"]
    assert got["model"] == [0.0, 14.0]          # 1 + 2 - 3, 1 + 4 + 9
    assert got["optimizer"] == [3.0, 77.0]      # 4 + 5 - 6, 16 + 25 + 36 (bool and uint8 not counted)
    assert got["empty"] == [0.0, 0.0]
    assert all(isinstance(v, float) for pair in got.values() for v in pair)


def test_fingerprint_tells_a_changed_state_from_the_saved_one():
    state = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)}}
    saved = resize.fingerprint(state)
    assert saved["model"] == [15.0, 55.0]
    state["model"]["w"][1, 2] += 1.0
    assert not resize.compare(saved, resize.fingerprint(state))["equal"]
    moved = {"model": {"w": torch.arange(6, dtype=torch.float32).reshape(3, 2)}}  # another split, the same values
    assert resize.compare(saved, resize.fingerprint(moved))["bit_exact"]


def test_a_sharded_tensor_counts_each_shard_once_over_the_job():
    """A DTensor is this rank's shard, divided by its replicas and added over the ranks (an all-reduce; the fake
    group's leaves it as it is, so this is rank 0's share): replicated on 2 ranks, each rank's copy counts half."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    with fake_group(rank=0, world_size=2):
        mesh = init_device_mesh("cpu", (2,))
        local = torch.tensor([1.0, 3.0])
        replicated = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        got = resize.fingerprint({"r": {"x": replicated}, "s": {"x": sharded, "y": torch.tensor([2.0])}})
    assert got["r"] == [2.0, 5.0]        # (1 + 3) / 2, (1 + 9) / 2
    assert got["s"] == [6.0, 14.0]       # the shard 1 + 3 plus the plain 2; 10 + 4


@pytest.mark.parametrize("saved, loaded, equal, bit_exact, worst", [
    ({"m": [1.0, 2.0]}, {"m": [1.0, 2.0]}, True, True, 0.0),
    ({"m": [0.0, 0.0]}, {"m": [0.0, 0.0]}, True, True, 0.0),
    ({"m": [1.0, 2.0]}, {"m": [1.0 + 1e-12, 2.0]}, True, False, pytest.approx(1e-12, rel=1e-3)),
    ({"m": [-2.0, 4.0]}, {"m": [-2.0, 4.0 * (1 + 5e-10)]}, True, False, pytest.approx(5e-10, rel=1e-6)),
    ({"m": [1.0, 2.0]}, {"m": [1.0, 2.0 * (1 + 1e-8)]}, False, False, pytest.approx(1e-8, rel=1e-6)),
    ({"m": [1.0, 2.0]}, {"m": [1.0, -2.0]}, False, False, 2.0),       # |2 - -2| / max(|2|, |-2|)
    ({"m": [0.0, 0.0]}, {"m": [0.0, 1e-200]}, False, False, 1.0),
    ({"m": [1.0, 2.0]}, {"m": [1.0, 2.0], "o": [0.0, 0.0]}, False, False, math.inf),  # a part more
    ({"m": [1.0, 2.0], "o": [0.0, 0.0]}, {"m": [1.0, 2.0]}, False, False, math.inf),  # a part less
    ({"m": [1.0, 2.0]}, {"m": [1.0]}, False, False, math.inf),
])
def test_compare_says_equal_only_within_the_tolerance(saved, loaded, equal, bit_exact, worst):
    got = resize.compare(saved, loaded)
    assert got["equal"] is equal and got["bit_exact"] is bit_exact
    assert got["max_rel_diff"] == worst
    assert got["tolerance"] == resize.TOLERANCE == 1e-9
    assert got["parts"] == sorted(set(saved) | set(loaded))


def test_compare_keeps_the_worst_part():
    got = resize.compare({"a": [1.0, 1.0], "b": [1.0, 1.0], "c": [1.0, 1.0]},
                         {"a": [1.0, 1.5], "b": [1.0, 1.0], "c": [1.25, 1.0]})
    assert got["max_rel_diff"] == pytest.approx(1 / 3) and not got["equal"]


def test_digest_check_compares_two_digests_and_none_without_a_saved_one():
    same = resize.digest_check("12", "12", ["envs", "agents"])
    assert same == {"equal": True, "bit_exact": True, "max_rel_diff": 0.0, "tolerance": 0.0,
                    "parts": ["agents", "envs"], "saved_digest": "12", "loaded_digest": "12"}
    other = resize.digest_check("12", "13", ["envs"])
    assert other["equal"] is False and other["bit_exact"] is False and other["max_rel_diff"] == math.inf
    assert resize.digest_check(None, "13", ["envs"]) is None
    assert resize.digest_check(12, "12", ["envs"]) is None  # not a digest string: written before digests were


def test_row_digest_tells_items_apart_and_ignores_their_order_and_split():
    ids = torch.arange(6, dtype=torch.int64)
    values = torch.tensor([[0.5, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0], [8.0, 9.0], [1.5, 2.5]])
    whole = resize.row_digest({"id": ids, "x": values})
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    halves = [resize.row_digest({"id": ids[order[:k]], "x": values[order[:k]]}) for k in (4,)] + \
        [resize.row_digest({"id": ids[order[4:]], "x": values[order[4:]]})]
    assert whole == sum(halves)  # rank shares add up to the job's, whatever the split
    changed = values.clone()
    changed[2, 1] = 5.5
    assert resize.row_digest({"id": ids, "x": changed}) != whole
    swapped = ids.clone()
    swapped[[0, 1]] = swapped[[1, 0]]  # the same values under other ids
    assert resize.row_digest({"id": swapped, "x": values}) != whole
    assert resize.row_digest({}) == 0 and resize.row_digest({"id": ids[:0]}) == 0
    with pytest.raises(ValueError, match="different lengths"):
        resize.row_digest({"id": ids, "x": values[:3]})


def test_records_digest_pads_each_row_to_whole_lanes_and_hashes_every_lane():
    rows = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], dtype=torch.uint8)
    padded = torch.cat([rows, rows.new_zeros(2, 3)], dim=1)
    assert resize.records_digest(rows) == resize.records_digest(padded)
    assert resize.records_digest(rows[:0]) == 0
    each = [resize.records_digest(rows[i:i + 1]) for i in range(2)]
    assert resize.records_digest(rows) == sum(each)
    for lane in range(2):  # a change in any lane, and the lanes' order, changes the hash
        changed = padded.clone()
        changed[0, 4 * lane] ^= 1
        assert resize.records_digest(changed[:1]) != each[0]
    assert resize.records_digest(torch.cat([padded[:1, 4:], padded[:1, :4]], dim=1)) != each[0]
    assert 0 < each[0] < 2 ** 32  # one 32-bit hash per row
    # lowbias32 chained from 0x2545F491 over the lanes, each xored with its lane number (1, 2, ...), as computed
    # by hand in plain Python: mix(0x2545F491 ^ 0 ^ 1); and row 0's two lanes
    assert resize.records_digest(torch.zeros(1, 4, dtype=torch.uint8)) == 3611715368
    assert each[0] == 2619703615


def test_compare_at_exactly_the_tolerance_is_equal(monkeypatch):
    monkeypatch.setattr(resize, "TOLERANCE", 0.5)  # |1 - 2| / 2, exactly
    assert resize.compare({"m": [1.0]}, {"m": [2.0]})["equal"] is True
    assert resize.compare({"m": [1.0]}, {"m": [2.5]})["equal"] is False


def test_describe_says_equal_or_warns_with_the_figures():
    assert "no fingerprint" in resize.describe(None)
    ok = resize.describe(resize.compare({"m": [1.0, 2.0]}, {"m": [1.0, 2.0]}))
    assert ok == "the state loaded equals the saved one (max relative difference 0.0e+00, tolerance 1e-09)"
    bad = resize.describe(resize.compare({"m": [1.0, 2.0]}, {"m": [1.0, 3.0]}))
    assert bad == ("WARNING: the state loaded differs from the saved one (max relative difference 3.3e-01, "
                   "tolerance 1e-09)")
    assert resize.describe(resize.digest_check("5", "5", [])) == (
        "the state loaded equals the saved one, bit for bit (digest 5)")
    assert resize.describe(resize.digest_check("5", "6", [])) == (
        "WARNING: the state loaded differs from the saved one (digest 6, saved 5)")


def test_recorded_appends_one_line_per_resize_and_reads_them_back(tmp_path):
    check = resize.compare({"m": [1.0, 2.0]}, {"m": [1.0, 2.0]})
    line = resize.recorded("train", tmp_path, from_ranks=2, to_ranks=3, step=40, checkpoint=tmp_path / "step_40",
                           check=check)
    assert line.startswith("multigpu train: resized from 2 to 3 rank(s) at step 40: the state loaded equals")
    resize.recorded("rl", tmp_path, from_ranks=3, to_ranks=1, step=8, checkpoint="c", check=None, unit="update")
    (tmp_path / resize.RESIZES_FILE).open("a").write("not json\n[1]\n")
    got = resize.read_resizes(tmp_path)
    assert [(r["from_ranks"], r["to_ranks"], r["step"]) for r in got] == [(2, 3, 40), (3, 1, 8)]
    assert got[0]["check"] == json.loads(json.dumps(check)) and got[0]["checkpoint"] == str(tmp_path / "step_40")
    assert got[1]["check"] is None and "time" in got[1]
    assert resize.read_resizes(tmp_path / "nowhere") == []
    resize.record(None, {"x": 1})  # no run folder: nothing written, no error


def test_fingerprint_sums_in_float64_skips_what_it_does_not_count_and_takes_any_keys():
    """Mutation testing: 1e8 + 1 is lost in float32; a bool tensor before a float one does not end the part; a state
    dict keyed by ints and strings alike (an optimizer's) is read in a fixed order."""
    big = torch.tensor([1e8, 1.0], dtype=torch.float64)
    got = resize.fingerprint({"p": {0: torch.tensor([True]), "w": big, 1: torch.tensor([2.0])}})
    assert got["p"] == [1e8 + 3.0, 1e16 + 1.0 + 4.0]


@pytest.mark.parametrize("world_size", [1, 2])
def test_only_the_shards_are_added_over_the_job_and_only_on_several_ranks(world_size, monkeypatch):
    """The all-reduce adds every rank's shards (here the fake group's stand-in doubles them, as a second rank with
    the same shard would); plain tensors, the same on every rank, are never added; one rank adds nothing. Sums in
    float64: 1e8 + 1 kept in a shard too."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: calls.append(1) or t.mul_(2))
    with fake_group(rank=0, world_size=world_size):
        mesh = init_device_mesh("cpu", (world_size,))
        shard = DTensor.from_local(torch.tensor([1e8, 1.0], dtype=torch.float64), mesh, [Shard(0)], run_check=False)
        got = resize.fingerprint({"s": {"x": shard}, "w": {"y": torch.tensor([3.0])}})
        plain = resize.fingerprint({"w": {"y": torch.tensor([3.0])}})
    times = 2 if world_size > 1 else 1
    assert got == {"s": [times * (1e8 + 1.0), times * (1e16 + 1.0)], "w": [3.0, 9.0]}
    assert plain == {"w": [3.0, 9.0]} and len(calls) == (1 if world_size > 1 else 0)


def test_a_shard_replicated_on_one_axis_of_a_2d_mesh_is_divided_by_that_axis_alone():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    with fake_group(rank=0, world_size=8):
        mesh = init_device_mesh("cpu", (2, 4))
        x = DTensor.from_local(torch.tensor([4.0]), mesh, [Replicate(), Shard(0)], run_check=False)
        y = DTensor.from_local(torch.tensor([4.0]), mesh, [Shard(0), Replicate()], run_check=False)
        got = resize.fingerprint({"x": x, "y": y})
    assert got == {"x": [2.0, 8.0], "y": [1.0, 4.0]}  # divided by 2 (axis 0), by 4 (axis 1)


def test_compare_scales_by_the_larger_of_the_two():
    assert resize.compare({"m": [4.0]}, {"m": [2.0]})["max_rel_diff"] == 0.5
    assert resize.compare({"m": [2.0]}, {"m": [4.0]})["max_rel_diff"] == 0.5


def test_records_digest_reads_each_lane_as_unsigned():
    """A lane whose top byte is 0x80 or more is a negative int32: it is hashed as the unsigned value (pinned from a
    plain-Python lowbias32 over the lane 0xFFFFFFFF)."""
    assert resize.records_digest(torch.full((1, 4), 0xFF, dtype=torch.uint8)) == 352933165
