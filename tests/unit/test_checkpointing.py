"""Checkpoints: atomic, checksummed, damage detected by name, a full disk leaves the previous one intact.

These pin the checkpoint contract on the one store of every workload
(:class:`multigpu.checkpoint.CheckpointStore`): a truncated or altered checkpoint
is never loaded silently (the newest *valid* one is used, and the message says
which file was skipped and why), and a save that fails half-way changes nothing
on disk.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import uuid

import pytest
import torch

import multigpu as mg
from multigpu.checkpoint import CheckpointStore, check_resume_path
from multigpu.checkpoint import store as store_module
from multigpu.checkpoint.files import atomic_write, sha256_file
from multigpu.cli import main
from multigpu.errors import CheckpointWriteError, CorruptCheckpointError


def _payload(step: int, size: int = 4096) -> bytes:
    return bytes([step % 251]) * size


class Blob:
    """A part of ``size`` bytes of one value (what ``step`` wrote)."""

    def __init__(self, step: int, size: int = 4096):
        self.data = torch.tensor(list(_payload(step, size)), dtype=torch.uint8)

    def state_dict(self):
        return {"data": self.data}


def _store(tmp_path, warnings: list[str] | None = None, keep_last: int = 3) -> CheckpointStore:
    sink = warnings if warnings is not None else []
    return CheckpointStore(tmp_path / "ckpts", keep_last, warn=sink.append)


def _snapshot(directory) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_save_records_size_and_sha256_and_keeps_the_last_k(tmp_path):
    store = _store(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        store.save(step, {"blob": Blob(step)})
    names = sorted(p.name for p in store.directory.iterdir())
    assert names == ["step_00000020", "step_00000030"]  # no temporaries left
    for path in store.folders():
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["step"] == int(path.name[5:])
        for name, entry in manifest["files"].items():
            assert (entry["bytes"], entry["sha256"]) == sha256_file(path / name)
    assert store.latest() == store.path_for(30)


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "state.pt is truncated (2,000 bytes on disk"),
    ("flip", "state.pt: checksum mismatch (SHA-256"),
    ("delete_entry", "state.pt is not listed in its manifest.json"),
])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, damage, reason):
    warnings: list[str] = []
    store = _store(tmp_path, warnings)
    for step in (1, 2):
        store.save(step, {"blob": Blob(step)})
    newest = store.path_for(2)
    state = newest / "state.pt"
    if damage == "truncate":
        with open(state, "r+b") as fh:
            fh.truncate(2000)
    elif damage == "flip":
        data = bytearray(state.read_bytes())
        data[1234] ^= 0x01  # one bit: same size, different content
        state.write_bytes(bytes(data))
    else:
        manifest = json.loads((newest / "manifest.json").read_text())
        del manifest["files"]["state.pt"]
        (newest / "manifest.json").write_text(json.dumps(manifest))
    assert store.latest() == store.path_for(1)
    assert len(warnings) == 1 and str(newest) in warnings[0] and reason in warnings[0], warnings
    with pytest.raises(CorruptCheckpointError, match=reason.split(" (")[0]) as info:
        store.verify(newest)
    assert info.value.path == newest


def _full_disk_after(limit: int):
    """A ``write(fh)`` that writes ``limit`` bytes of a bigger state, then fails as a full disk does."""
    def write(fh):
        fh.write(b"x" * limit)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


def test_a_full_disk_mid_file_leaves_the_folder_as_it_was(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.save(1, {"blob": Blob(1)})
    before = _snapshot(store.directory)
    monkeypatch.setattr(torch, "save", lambda obj, fh: _full_disk_after(1000)(fh))
    with pytest.raises(CheckpointWriteError) as info:
        store.save(2, {"blob": Blob(2)})
    message = str(info.value)
    assert "\n" not in message
    assert f"could not write checkpoint {store.path_for(2)}: No space left on device (ENOSPC)" in message
    assert "the previous checkpoint step_00000001 is intact" in message
    assert _snapshot(store.directory) == before  # no temporary, same manifest, same checkpoint
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000001"]
    assert store.latest() == store.path_for(1)


def test_a_full_disk_while_recording_the_manifest_removes_the_new_checkpoint(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.save(1, {"blob": Blob(1)})
    before = _snapshot(store.directory)
    real = store_module.atomic_write

    def no_room_for_the_manifest(path, write):
        if path.name == "manifest.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, write)

    monkeypatch.setattr(store_module, "atomic_write", no_room_for_the_manifest)
    with pytest.raises(CheckpointWriteError, match="step_00000001 is intact"):
        store.save(2, {"blob": Blob(2)})
    assert _snapshot(store.directory) == before
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000001"]


def test_stale_temporaries_of_a_killed_writer_are_ignored_then_removed(tmp_path):
    store = _store(tmp_path)
    store.save(1, {"blob": Blob(1)})
    stale = store.directory / ".step_00000002.tmp"
    stale.mkdir()
    (stale / "state.pt").write_bytes(b"half")  # what a SIGKILL during a save leaves
    assert store.latest() == store.path_for(1)
    store.save(3, {"blob": Blob(3)})
    assert not stale.exists()


def test_atomic_write_keeps_the_old_file_when_the_write_fails(tmp_path):
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    with pytest.raises(OSError):
        atomic_write(target, _full_disk_after(10))
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 256 KiB file system (needs root and mount rights; skipped elsewhere)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", f"multigpu-{uuid.uuid4().hex[:6]}", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_really_full_disk_with_torch_save(tiny_tmpfs):
    """A real ENOSPC from the kernel, not a simulated one: 100 KiB fits once, not twice (keep_last=3)."""
    store = CheckpointStore(tiny_tmpfs, keep_last=3, warn=lambda m: None)
    store.save(1, {"w": torch.zeros(25_000)})
    before = _snapshot(tiny_tmpfs)
    with pytest.raises(CheckpointWriteError, match=r"No space left on device \(ENOSPC\); the previous checkpoint"):
        store.save(2, {"w": torch.ones(40_000)})
    assert _snapshot(tiny_tmpfs) == before
    assert torch.equal(store.load(store.latest(), {"w": None})["w"], torch.zeros(25_000))


def test_training_checkpoints_fall_back_past_a_damaged_one_and_refuse_it_by_path(tmp_path, capsys):
    """On one rank: auto skips the bad checkpoint (warned on stderr); an explicit path to it is an error."""
    mg.init(backend="cpu", threads=1)
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=3)
    for step in (2, 4):
        store.save(step, {"model": {"w": torch.full((3,), float(step))}, "optimizer": {}})
    newest = store.path_for(4) / "state.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    assert store.latest() == store.path_for(2)
    assert "checksum mismatch" in capsys.readouterr().err
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint {store.path_for(4)} is unusable: state.pt: "
                                                     "checksum mismatch"):
        check_resume_path(str(store.path_for(4)))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        with open(store.path_for(2) / "state.pt", "r+b") as fh:
            fh.truncate(100)
        store.verify(store.path_for(2))


def test_resume_from_a_damaged_file_is_one_line_exit_2_before_anything_starts(tmp_path, capsys):
    store = CheckpointStore(tmp_path / "old" / "checkpoints")
    store.save(5, {"trainer": {"step": 5}})
    bad = store.path_for(5)
    with open(bad / "state.pt", "r+b") as fh:
        fh.truncate(50)
    run_dir = tmp_path / "run"
    code = main(["train", "-f", "nano", "--run-dir", str(run_dir), "--resume", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"error: --resume {bad}: state.pt is truncated (50 bytes on disk") and \
        "valid: an intact checkpoint" in err
    assert not run_dir.exists()
