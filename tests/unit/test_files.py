"""Atomic writes: the target is the old file or the whole new one; a failed write leaves no temporary."""

from __future__ import annotations

import json

import pytest

from multigpu.files import atomic_path, write_json_atomic, write_text_atomic


def test_success_replaces_and_failure_keeps_the_old_file_without_leftovers(tmp_path):
    target = tmp_path / "deep" / "out.txt"
    write_text_atomic(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer died")
    assert target.read_text() == "old"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]
    write_json_atomic(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}


def test_keep_suffix_ends_the_temporary_with_the_format(tmp_path):
    with atomic_path(tmp_path / "plot.png", keep_suffix=True) as tmp:
        # the target's own name, in a hidden folder of the writer's own beside it (issue 48: no guessable name)
        assert tmp.suffix == ".png" and tmp.name == "plot.png" and tmp.resolve().parent.name.startswith(".plot.png.")
        assert tmp.resolve().parent.parent == tmp_path
        tmp.write_bytes(b"png")
    assert (tmp_path / "plot.png").read_bytes() == b"png"
