"""Window grid, split over ranks, ownership and blending: pure math, checked against brute force and MONAI."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from multigpu.errors import ConfigError
from multigpu.infer.stitch import Canvas, importance_map
from multigpu.infer.windows import WindowPlan, as_tuple, make_grid

sizes = st.integers(min_value=1, max_value=40)
rois = st.integers(min_value=1, max_value=16)
overlaps = st.sampled_from([0.0, 0.25, 0.5, 0.6, 0.9])


def _all_windows(grid):
    return [grid.start(k) for k in range(grid.num_windows)]


@settings(max_examples=80, deadline=None)
@given(size=st.tuples(sizes, sizes), roi=st.tuples(rois, rois), overlap=st.tuples(overlaps, overlaps))
def test_grid_covers_every_voxel_and_stays_inside_the_padded_image(size, roi, overlap):
    grid = make_grid(size, roi, overlap)
    covered = np.zeros(grid.padded_size, dtype=int)
    for start in _all_windows(grid):
        assert all(s >= 0 and s + r <= p for s, r, p in zip(start, roi, grid.padded_size, strict=True))
        covered[tuple(slice(s, s + r) for s, r in zip(start, roi, strict=True))] += 1
    assert covered.min() >= 1
    assert len(set(_all_windows(grid))) == grid.num_windows  # no window twice
    for (a, b), s, r in zip(grid.pad, size, roi, strict=True):
        assert (a, b) == ((r - s) // 2, r - s - (r - s) // 2) if r > s else (a, b) == (0, 0)


@settings(max_examples=60, deadline=None)
@given(size=st.tuples(sizes, sizes), roi=st.tuples(rois, rois), overlap=st.tuples(overlaps, overlaps))
def test_grid_positions_are_monais(size, roi, overlap):
    data_utils = pytest.importorskip("monai.data.utils")
    from monai.inferers.utils import _get_scan_interval

    grid = make_grid(size, roi, overlap)
    interval = _get_scan_interval(grid.padded_size, roi, 2, overlap)
    theirs = [tuple(s.start for s in sl) for sl in data_utils.dense_patch_slices(grid.padded_size, roi, interval)]
    assert _all_windows(grid) == theirs


@settings(max_examples=80, deadline=None)
@given(counts=st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=4),
       batch=st.integers(min_value=1, max_value=7), world=st.integers(min_value=1, max_value=6))
def test_rank_bounds_give_every_window_to_exactly_one_rank_in_whole_batches(counts, batch, world):
    plan = WindowPlan([(c, 1) for c in counts], (1, 1), (0.0, 0.0))  # c x 1 images of roi 1: c windows each
    assert plan.num_windows == sum(counts)
    bounds = plan.rank_bounds(batch, world)
    assert bounds[0][0] == 0 and bounds[-1][1] == plan.num_windows
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous, in rank order
    assert all(start % batch == 0 or start == stop for start, stop in bounds)  # batches never split
    owners = plan.owner(np.arange(plan.num_windows), bounds)
    for r, (start, stop) in enumerate(bounds):
        assert (owners[start:stop] == r).all()


@settings(max_examples=50, deadline=None)
@given(size=st.tuples(sizes, sizes), roi=st.tuples(rois, rois), overlap=st.tuples(overlaps, overlaps),
       scale=st.sampled_from([(1, 1), (2, 2), (1, 3)]))
def test_first_window_is_the_lowest_window_covering_each_voxel(size, roi, overlap, scale):
    plan = WindowPlan([size], roi, overlap)
    grid = plan.grids[0]
    out_size = tuple(p * z for p, z in zip(grid.padded_size, scale, strict=True))
    brute = np.full(out_size, -1)
    for k in reversed(range(grid.num_windows)):
        box = plan.covers(0, k, scale)
        brute[tuple(slice(b.start, b.stop) for b in box)] = k
    fast = grid.first_window([np.arange(n) for n in out_size], scale)
    assert (fast == brute).all()
    for d, n in enumerate(out_size):  # runs of one lowest covering index tile the axis
        runs = plan.segments(0, d, 0, n, scale[d])
        assert runs[0][0] == 0 and runs[-1][1] == n and all(a[1] == b[0] for a, b in itertools.pairwise(runs))
        for a, b, i in runs:
            assert (grid.first_cover(d, np.arange(a, b), scale[d]) == i).all()
    for k in range(grid.num_windows):
        box = tuple(slice(b.start, b.stop) for b in plan.covers(0, k, scale))
        assert set(plan.first_windows_inside(0, k, scale)) == set(np.unique(brute[box]).tolist())


def test_output_box_and_crop_box():
    plan = WindowPlan([(10, 10), (5, 30)], (4, 8), (0.5, 0.5))
    g0, g1 = plan.grids
    assert g0.starts == ((0, 2, 4, 6), (0, 2)) and g1.pad == ((0, 0), (0, 0))
    assert plan.output_box(0, 0, 2, (1, 1)) == ((0, 4), (0, 10))  # first row of windows
    assert plan.output_box(0, 7, 8, (2, 2)) == ((12, 20), (4, 20))  # last window, output scaled x2
    small = WindowPlan([(3, 20)], (6, 6), (0.25, 0.25))
    assert small.grids[0].pad == ((1, 2), (0, 0))
    assert small.crop_box(0, (2, 1)) == ((2, 8), (0, 20))
    assert list(small.images_in(0, small.num_windows)) == [0]


def test_as_tuple_and_errors():
    assert as_tuple(3, 2, "roi") == (3, 3) and as_tuple([3], 3, "roi") == (3, 3, 3)
    with pytest.raises(ConfigError, match="has 3 entries"):
        as_tuple([1, 2, 3], 2, "roi")
    with pytest.raises(ConfigError, match="empty"):
        make_grid((0, 5), (2, 2), (0.0, 0.0))


def test_importance_map_is_monais_including_resize():
    data_utils = pytest.importorskip("monai.data.utils")
    for roi, blend in [((16, 24), "gaussian"), ((8, 8, 6), "gaussian"), ((5, 7), "constant")]:
        assert torch.equal(importance_map(roi, blend), data_utils.compute_importance_map(roi, blend))
    resized = importance_map((6, 6), "gaussian", out_size=(12, 12))
    assert torch.equal(resized[::2, ::2], importance_map((6, 6), "gaussian"))
    assert torch.equal(resized[1::2, 1::2], importance_map((6, 6), "gaussian"))


def test_importance_map_shape_and_floor():
    w = importance_map((32, 32), "gaussian", sigma_scale=0.05)
    assert w.shape == (32, 32) and w.min().item() == pytest.approx(1e-3)
    assert w[15:17, 15:17].min() > 0.9 and w.max() <= 1.0
    with pytest.raises(ConfigError, match="blend='median'"):
        importance_map((4, 4), "median")


def test_canvas_blends_the_weighted_mean_and_drops_what_falls_outside():
    canvas = Canvas(2, ((0, 4), (2, 8)))
    ones = torch.ones(4, 4)
    canvas.add(torch.full((2, 4, 4), 1.0), ones, (0, 0))  # only columns 2..3 land inside
    canvas.add(torch.full((2, 4, 4), 3.0), 3 * ones, (0, 2))
    canvas.add(torch.full((2, 4, 4), 9.0), ones, (10, 10))  # entirely outside: ignored
    out = canvas.blended(((0, 4), (2, 8)))
    assert out.shape == (2, 4, 6)
    assert torch.allclose(out[:, :, :2], torch.full((2, 4, 2), (1 + 9) / 4))
    assert torch.equal(out[:, :, 2:4], torch.full((2, 4, 2), 3.0))
    assert torch.isnan(out[:, :, 4:]).all()  # no window touched them: 0 / 0


def test_the_windows_of_every_rank_are_every_window_of_every_image_once():
    """Mutation testing: ``windows(start, stop)`` (what a rank evaluates) was never called by a fast test."""
    plan = WindowPlan([(5, 4), (3, 3)], (2, 2), (0.0, 0.0))  # 3 x 2 windows, then 2 x 2
    assert plan.num_windows == 10 and plan.offsets == (0, 6, 10)
    bounds = plan.rank_bounds(batch_size=3, world_size=2)
    assert bounds == [(0, 6), (6, 10)]
    seen = [(w.index, w.image, w.local, w.start) for start, stop in bounds for w in plan.windows(start, stop)]
    assert [s[0] for s in seen] == list(range(10))
    assert [(s[1], s[2]) for s in seen] == [(0, k) for k in range(6)] + [(1, k) for k in range(4)]
    assert seen[5][3] == (3, 2) and seen[9][3] == (1, 1)  # the last window of each image reaches its end
    assert list(plan.windows(4, 4)) == [] and [w.index for w in plan.windows(5, 7)] == [5, 6]


def test_a_windows_output_box_is_its_start_and_size_times_the_scale():
    plan = WindowPlan([(5, 4)], (2, 2), (0.0, 0.0))
    start = plan.window(5).start
    assert plan.covers(0, 5, (1, 1)) == (range(start[0], start[0] + 2), range(start[1], start[1] + 2))
    assert plan.covers(0, 5, (2, 3)) == (range(2 * start[0], 2 * (start[0] + 2)), range(3 * start[1], 3 * (start[1] + 2)))
