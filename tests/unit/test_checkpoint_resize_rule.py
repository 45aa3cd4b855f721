"""When a resume is a resize (:func:`multigpu.checkpoint.resize.resized_from`), as a rule over the run folder."""

from __future__ import annotations

from multigpu.checkpoint.resize import record, resized_from


def test_a_resume_is_a_resize_from_the_checkpoints_size_or_from_the_size_the_run_last_ran_at_from_it(tmp_path):
    assert resized_from(tmp_path, 2, 2) is None  # the checkpoint's size, and no other size since
    assert resized_from(tmp_path, 2, 1) == 2 and resized_from(None, 2, 3) == 2
    record(tmp_path, {"from_ranks": 2, "to_ranks": 1, "step": 100})
    # the 1-rank group wrote no checkpoint; the node came back: 2 ranks again from the same 2-rank checkpoint
    assert resized_from(tmp_path, 2, 2) == 1
    assert resized_from(tmp_path, 1, 2) == 1  # a checkpoint the 1-rank group wrote: its size, as before
    assert resized_from(tmp_path, 2, 3) == 2
    record(tmp_path, {"from_ranks": 1, "to_ranks": 2, "step": 100})
    assert resized_from(tmp_path, 2, 2) is None  # a plain restart at the size the run last ran at
