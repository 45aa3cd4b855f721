"""What the checkpoint store trusts (:mod:`multigpu.checkpoint.store`), check by check: the manifest's shape, every
file listed and present with its size and SHA-256, the folders that count as this store's, the newest usable one,
and the rotation's cache of what verified. Mutation testing found checks no fast test made fail."""

from __future__ import annotations

import json
import os

import pytest
import torch

from multigpu.checkpoint import CheckpointStore, CorruptCheckpointError, OldLayoutError
from multigpu.checkpoint import store as store_module
from tests.counter import Counter

SHA = "0" * 64


def _saved(tmp_path, *steps, keep_last=10):
    warnings: list[str] = []
    store = CheckpointStore(tmp_path / "checkpoints", keep_last, warn=warnings.append)
    for step in steps:
        store.save(step, {"c": Counter(step)})
    return store, warnings


@pytest.mark.parametrize("data, problem", [
    ([], "is not a format-2 checkpoint manifest"),
    ({"format": 1, "step": 1, "world_size": 1, "files": {}}, "is not a format-2 checkpoint manifest"),
    ({"format": 2, "step": 1, "world_size": 1, "files": []}, "is not a format-2 checkpoint manifest"),
    ({"format": 2, "world_size": 1, "files": {}}, "records step as null, not a whole number >= 0"),
    ({"format": 2, "step": -1, "world_size": 1, "files": {}}, "records step as -1, not a whole number >= 0"),
    ({"format": 2, "step": True, "world_size": 1, "files": {}}, "records step as true, not a whole number >= 0"),
    ({"format": 2, "step": 1.0, "world_size": 1, "files": {}}, "records step as 1.0, not a whole number >= 0"),
    ({"format": 2, "step": 1, "world_size": 0, "files": {}}, "records world_size as 0, not a whole number >= 1"),
    ({"format": 2, "step": 1, "world_size": 1, "files": {}, "meta": []}, "records meta as something other than"),
    ({"format": 2, "step": 1, "world_size": 1, "files": {"a": {"bytes": -1, "sha256": SHA}}}, "records a as"),
    ({"format": 2, "step": 1, "world_size": 1, "files": {"a": {"bytes": 1, "sha256": "AB" * 32}}}, "records a as"),
    ({"format": 2, "step": 1, "world_size": 1, "files": {"a": {"bytes": 1, "sha256": SHA[:63]}}}, "records a as"),
    ({"format": 2, "step": 1, "world_size": 1, "files": {"a": {"bytes": 1, "sha256": SHA + "0"}}}, "records a as"),
    ({"format": 2, "step": 1, "world_size": 1, "files": {"a": {"bytes": 1}}}, "records a as"),
    ({"format": 2, "step": 1, "world_size": 1, "files": {"a": [1, SHA]}}, "records a as"),
])
def test_a_manifest_of_another_shape_is_named_by_what_is_wrong(data, problem):
    got = store_module._manifest_problem(data)
    assert got is not None and got.startswith(problem), got


def test_a_manifest_this_store_writes_passes():
    good = {"format": 2, "step": 0, "world_size": 1, "files": {"a": {"bytes": 0, "sha256": "ab" * 32}}}
    assert store_module._manifest_problem(good) is None
    assert store_module._manifest_problem({**good, "meta": {"x": 1}}) is None
    assert store_module._manifest_problem({**good, "files": {}}) is None


def test_every_file_must_be_listed_present_and_the_size_and_checksum_written(tmp_path):
    store, _ = _saved(tmp_path, 4)
    path = store.path_for(4)
    assert store_module.verify(path)["step"] == 4 and store.verify(path)["step"] == 4
    state = path / "state.pt"
    original = state.read_bytes()
    state.write_bytes(original + b"x")
    with pytest.raises(CorruptCheckpointError, match=r"state.pt is not the size written \([\d,]+ bytes on disk"):
        store_module.verify(path)
    for only in ((), ("other.pt",), ("state.pt",)):  # a size is a stat: checked for every file, hashed or not
        with pytest.raises(CorruptCheckpointError, match="state.pt is not the size written"):
            store_module.verify(path, only=only)
    state.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # the size written, other bytes
    assert store_module.verify(path, only=())["step"] == 4  # checksums left to the ranks
    assert store_module.verify(path, only=("other.pt",))["step"] == 4
    with pytest.raises(CorruptCheckpointError, match="state.pt: checksum mismatch"):
        store_module.verify(path, only=("state.pt",))
    state.write_bytes(original[:-1])
    with pytest.raises(CorruptCheckpointError, match="state.pt is truncated"):
        store_module.verify(path)
    state.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match="state.pt: checksum mismatch"):
        store_module.verify(path)
    state.write_bytes(original)
    (path / "notes.txt").write_text("x")
    with pytest.raises(CorruptCheckpointError, match="notes.txt is not listed in its manifest.json"):
        store_module.verify(path, only=())
    (path / "notes.txt").unlink()
    state.unlink()
    state.mkdir()
    with pytest.raises(CorruptCheckpointError, match="state.pt is missing"):
        store_module.verify(path, only=())
    state.rmdir()
    with pytest.raises(CorruptCheckpointError, match="state.pt is missing"):
        store_module.verify(path, only=())
    state.write_bytes(original)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["../state.pt"] = {"bytes": 1, "sha256": SHA}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CorruptCheckpointError, match=r"\.\./state.pt is missing"):
        store_module.verify(path, only=())
    with pytest.raises(CorruptCheckpointError, match="it is not a checkpoint folder"):
        store_module.verify(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(CorruptCheckpointError, match=r"its manifest.json cannot be read \(JSONDecodeError\)"):
        store_module.read_manifest(tmp_path)


def test_only_step_folders_of_eight_digits_or_more_count_in_step_order(tmp_path):
    store, _ = _saved(tmp_path, 9, 10)
    (store.directory / "step_123456789").mkdir()  # nine digits: a step past 99,999,999
    (store.directory / "step_1234567").mkdir()  # seven: not this store's
    (store.directory / "step_00000050").write_text("a file")
    os.symlink(store.path_for(10), store.directory / "step_00000099")
    assert [p.name for p in store._step_folders()] == ["step_00000009", "step_00000010", "step_123456789"]
    assert CheckpointStore(tmp_path / "none")._step_folders() == []
    assert store.own_problem(store.path_for(9)) is None
    assert "it is not a checkpoint folder" in store.own_problem(store.directory / "step_123456789")
    (store.path_for(10)).rename(store.directory / "step_00000011")
    assert store.own_problem(store.directory / "step_00000011") == (
        "its manifest.json records step 10, not the step its folder is named after")
    assert [p.name for p in store.folders()] == ["step_00000009"]
    assert store_module.is_checkpoint(store.path_for(9)) and not store_module.is_checkpoint(tmp_path / "x")
    (tmp_path / "odd" / "manifest.json").mkdir(parents=True)
    assert not store_module.is_checkpoint(tmp_path / "odd")


def test_the_newest_usable_checkpoint_and_why_each_newer_one_is_not(tmp_path):
    store, warnings = _saved(tmp_path, 2, 4, 6)
    (store.path_for(6) / "state.pt").unlink()
    state = store.path_for(4) / "state.pt"
    state.write_bytes(state.read_bytes()[:-1] + bytes([state.read_bytes()[-1] ^ 1]))
    found, unusable = store.scan()
    assert found == store.path_for(2)
    assert [(p.name, why.split(" (")[0]) for p, why in unusable] == [("step_00000006", "state.pt is missing"),
                                                                      ("step_00000004", "state.pt: checksum mismatch")]
    assert store.scan(checksums=False).found == store.path_for(4)  # the launcher reads no bytes
    assert store.latest() == store.path_for(2) and store.skipped == unusable
    assert warnings == [f"skipping checkpoint {path} (unusable: {why})" for path, why in unusable]
    (store.path_for(2) / "state.pt").unlink()
    assert store.scan().found is None and len(store.scan().unusable) == 3
    (store.directory / "ckpt_00000004.pt").write_bytes(b"x")
    (store.directory / "manifest.json").write_text('{"format": 1, "checkpoints": []}')
    with pytest.raises(OldLayoutError):
        store.scan()


def test_keep_last_is_one_at_least_and_rotation_trusts_a_folder_unchanged_since_it_verified(tmp_path):
    with pytest.raises(ValueError, match="keep_last=0 must be >= 1"):
        CheckpointStore(tmp_path, 0)
    assert CheckpointStore(tmp_path, 1).keep_last == 1
    store, _ = _saved(tmp_path, 2, 3, keep_last=2)
    assert store._is_valid(store.path_for(2))
    state = store.path_for(3) / "state.pt"
    before = state.stat()
    state.write_bytes(state.read_bytes()[:-1] + bytes([state.read_bytes()[-1] ^ 1]))
    os.utime(state, ns=(before.st_atime_ns, before.st_mtime_ns))  # same name, size and time: not hashed again
    assert store._is_valid(store.path_for(3))
    os.utime(state, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))  # touched: hashed, and damaged
    assert not store._is_valid(store.path_for(3))
    fresh = CheckpointStore(store.directory, 2)
    assert not fresh._is_valid(store.path_for(3)) and fresh._is_valid(store.path_for(2))


class _NotPlain:
    pass


def _folder(tmp_path, files: dict[str, bytes]):
    """A checkpoint folder written by hand: ``files`` and a manifest with their true sizes and checksums."""
    from multigpu.checkpoint.files import sha256_file

    path = tmp_path / "step_00000001"
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    listed = {}
    for name in files:
        size, digest = sha256_file(path / name)
        listed[name] = {"bytes": size, "sha256": digest}
    (path / "manifest.json").write_text(json.dumps({"format": 2, "step": 1, "world_size": 1, "files": listed}))
    return path


def test_a_state_file_naming_code_is_refused_only_where_it_is_read_and_only_listed_files_are_hashed(tmp_path):
    import io

    buf = io.BytesIO()
    torch.save({"x": _NotPlain()}, buf)
    path = _folder(tmp_path, {"a.distcp": b"shard", "state.pt": buf.getvalue()})
    with pytest.raises(CorruptCheckpointError, match="it refers to .*_NotPlain, which is not a tensor or plain value"):
        store_module.verify(path)
    with pytest.raises(CorruptCheckpointError, match="_NotPlain"):
        store_module.verify(path, only=("state.pt",))
    assert store_module.verify(path, only=("a.distcp",))["step"] == 1  # the shard only: state.pt not opened
    assert store_module.verify(path, only=())["step"] == 1
    (path / "state.pt").write_bytes(b"x" * len(buf.getvalue()))  # same size, another checksum: found after a.distcp
    with pytest.raises(CorruptCheckpointError, match="state.pt: checksum mismatch"):
        store_module.verify(path, only=("state.pt",))
    (tmp_path / "b").mkdir()
    shards_only = _folder(tmp_path / "b", {"a.distcp": b"shard"})
    assert store_module.verify(shards_only)["files"].keys() == {"a.distcp"}  # no state.pt: nothing to unpickle


def test_a_manifests_problem_quotes_what_it_holds():
    long = "x" * 60
    assert store_module._manifest_problem({"format": 2, "step": long, "world_size": 1, "files": {}}) == (
        f'records step as "{long[:39]}, not a whole number >= 0')
    entry = {"bytes": 1, "sha256": "y" * 100}
    assert store_module._manifest_problem({"format": 2, "step": 1, "world_size": 1, "files": {"a": entry}}) == (
        f"records a as {json.dumps(entry)[:80]}, not a size in bytes and a SHA-256")
    assert store_module._manifest_problem({"format": 2, "step": 1, "world_size": 1, "files": {}, "meta": 3}) == (
        "records meta as something other than a JSON object")


def test_rotation_keeps_the_newest_valid_ones_counting_a_newer_folder_and_the_one_just_written(tmp_path):
    """keep_last=3 keeps three; a valid folder of a higher step (a run resumed from an earlier one) counts before
    the one just written; the defaults: keep_last 3, nothing skipped yet; a folder verified once by rotation is
    not hashed again while its files are unchanged (mutation testing)."""
    store, _ = _saved(tmp_path / "a", 1, 2, 3, 4, keep_last=3)
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000002", "step_00000003", "step_00000004"]
    other, _ = _saved(tmp_path / "b", 2, 4, 8, keep_last=10)
    resumed = CheckpointStore(other.directory, 2, warn=lambda _: None)
    resumed.save(5, {"c": Counter(5)})
    assert sorted(p.name for p in other.directory.iterdir()) == ["step_00000005", "step_00000008"]
    fresh = CheckpointStore(tmp_path / "c")
    assert fresh.keep_last == 3 and fresh.skipped == []
    looked = CheckpointStore(other.directory, 2, warn=lambda _: None)
    assert looked._is_valid(other.path_for(8))  # verified by hashing, and remembered
    state = other.path_for(8) / "state.pt"
    before = state.stat()
    state.write_bytes(state.read_bytes()[:-1] + bytes([state.read_bytes()[-1] ^ 1]))
    os.utime(state, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert looked._is_valid(other.path_for(8))


def test_step_folders_are_in_step_order_across_widths(tmp_path):
    store, _ = _saved(tmp_path, 99999999)
    (store.directory / "step_123456789").mkdir()
    (store.directory / "step_100000000").mkdir()
    assert [p.name for p in store._step_folders()] == ["step_99999999", "step_100000000", "step_123456789"]
