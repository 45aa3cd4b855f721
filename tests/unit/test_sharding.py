"""Exactly-once sharding: every item on exactly one rank, balanced, contiguous, in order."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from multigpu.errors import ConfigError
from multigpu.runtime.samplers import ShardSampler, TrainSampler
from multigpu.runtime.sharding import shard, shard_bounds, shard_range, shard_sizes

lengths = st.integers(min_value=0, max_value=50)
world_sizes = st.integers(min_value=1, max_value=9)


@given(n=lengths, world=world_sizes)
def test_shard_range_covers_every_index_exactly_once_in_order(n, world):
    parts = [list(shard_range(n, rank=r, world_size=world)) for r in range(world)]
    assert [i for p in parts for i in p] == list(range(n))  # exactly once, original order
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1  # balanced
    assert sizes == sorted(sizes, reverse=True)  # lower ranks get the extra items
    assert sizes == shard_sizes(n, world)


@given(items=st.lists(st.integers(), max_size=50), world=world_sizes)
def test_shard_is_deterministic_and_concatenates_back(items, world):
    parts = [shard(items, rank=r, world_size=world) for r in range(world)]
    assert [x for p in parts for x in p] == items
    assert parts == [shard(items, rank=r, world_size=world) for r in range(world)]


@given(items=st.lists(st.integers(), min_size=1, max_size=50), world=world_sizes)
def test_shard_pad_gives_equal_lengths_and_real_items_first(items, world):
    parts = [shard(items, pad=True, rank=r, world_size=world) for r in range(world)]
    assert len({len(p) for p in parts}) == 1
    for r, p in enumerate(parts):
        real = shard(items, rank=r, world_size=world)
        assert list(p[: len(real)]) == list(real)
        assert all(x in items for x in p)


def test_world_larger_than_items_leaves_high_ranks_empty():
    assert [list(shard_range(2, rank=r, world_size=4)) for r in range(4)] == [[0], [1], [], []]
    assert shard_bounds(0, 0, 3) == (0, 0)


@pytest.mark.parametrize("n,rank,world", [(-1, 0, 1), (3, 2, 2), (3, -1, 2), (3, 0, 0)])
def test_bad_coordinates_raise_config_error(n, rank, world):
    with pytest.raises(ConfigError):
        shard_bounds(n, rank, world)


@given(n=lengths, world=world_sizes)
def test_shard_sampler_is_exactly_once_without_padding(n, world):
    seen = [i for r in range(world) for i in ShardSampler(n, rank=r, world_size=world)]
    assert seen == list(range(n))
    assert sum(len(ShardSampler(n, rank=r, world_size=world)) for r in range(world)) == n


@given(n=st.integers(min_value=9, max_value=60), world=world_sizes, drop_last=st.booleans())
def test_train_sampler_equal_lengths_and_global_batches_match_one_rank(n, world, drop_last):
    samplers = [TrainSampler(n, seed=3, drop_last=drop_last, rank=r, world_size=world) for r in range(world)]
    per_rank = [list(s) for s in samplers]
    assert len({len(p) for p in per_rank}) == 1  # no rank waits on another
    one = TrainSampler(n, seed=3, drop_last=drop_last, rank=0, world_size=1).indices(0)
    # strided slices: step t on W ranks with batch b holds the 1-rank batch t of size W*b
    interleaved = [per_rank[r][i] for i in range(len(per_rank[0])) for r in range(world)]
    assert interleaved == (one * 2)[: len(interleaved)]
    if drop_last:
        assert len(set(interleaved)) == len(interleaved)


def test_train_sampler_advances_epochs_without_set_epoch():
    s = TrainSampler(20, seed=0, rank=0, world_size=1)
    first, second = list(s), list(s)
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second  # a fresh shuffle each epoch, nothing to forget
    assert s.epoch == 2


def test_train_sampler_resumes_mid_epoch():
    s = TrainSampler(20, seed=1, rank=1, world_size=2)
    full = list(s)  # epoch 0
    state = s.state_dict(consumed=4)
    resumed = TrainSampler(20, seed=1, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert len(resumed) == len(full) - 4
    assert list(resumed) == full[4:]
    assert list(resumed) == s.indices(1)  # then the next epoch as usual


def test_train_sampler_too_small_dataset_is_a_clear_error():
    with pytest.raises(ConfigError, match="too small for 4 ranks"):
        TrainSampler(3, rank=0, world_size=4)
