"""Checkpoint files: atomic, checksummed, damage detected by name, a full disk leaves the previous one intact.

These pin the contract of issue 8: a truncated or altered checkpoint is never
loaded silently (the newest *valid* one is used, and the message says which
file was skipped and why), and a save that fails half-way changes nothing on
disk.
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
from multigpu.checkpointing import (
    CheckpointFolder,
    CheckpointWriteError,
    CorruptCheckpointError,
    atomic_write,
    sha256_file,
)
from multigpu.cli import main
from multigpu.train import CheckpointManager
from multigpu.train.checkpoint import check_checkpoint, find_latest


def _payload(step: int, size: int = 4096) -> bytes:
    return bytes([step % 251]) * size


def _folder(tmp_path, warnings: list[str] | None = None, keep_last: int = 3) -> CheckpointFolder:
    sink = warnings if warnings is not None else []
    return CheckpointFolder(tmp_path / "ckpts", keep_last, warn=sink.append)


def _snapshot(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_save_records_size_and_sha256_and_keeps_the_last_k(tmp_path):
    folder = _folder(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        folder.save(step, lambda fh, s=step: fh.write(_payload(s)))
    names = sorted(p.name for p in folder.directory.iterdir())
    assert names == ["ckpt_00000020.pt", "ckpt_00000030.pt", "manifest.json"]  # no temporaries left
    manifest = json.loads(folder.manifest_path.read_text())
    assert [e["step"] for e in manifest["checkpoints"]] == [20, 30]
    for entry in manifest["checkpoints"]:
        assert (entry["bytes"], entry["sha256"]) == sha256_file(folder.directory / entry["file"])
    assert folder.latest_valid() == folder.path_for(30)


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "truncated: 2,000 bytes on disk, 4,096 written"),
    ("flip", "checksum mismatch: SHA-256"),
    ("delete_entry", "is not listed in"),
])
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_used(tmp_path, damage, reason):
    warnings: list[str] = []
    folder = _folder(tmp_path, warnings)
    for step in (1, 2):
        folder.save(step, lambda fh, s=step: fh.write(_payload(s)))
    newest = folder.path_for(2)
    if damage == "truncate":
        with open(newest, "r+b") as fh:
            fh.truncate(2000)
    elif damage == "flip":
        data = bytearray(newest.read_bytes())
        data[1234] ^= 0x01  # one bit: same size, different content
        newest.write_bytes(bytes(data))
    else:
        manifest = json.loads(folder.manifest_path.read_text())
        manifest["checkpoints"] = manifest["checkpoints"][:1]
        folder.manifest_path.write_text(json.dumps(manifest))
    assert folder.latest_valid() == folder.path_for(1)
    assert len(warnings) == 1 and str(newest) in warnings[0] and reason in warnings[0], warnings
    with pytest.raises(CorruptCheckpointError, match=reason.split(":")[0]) as info:
        folder.verify(newest)
    assert info.value.path == newest


def _full_disk_after(limit: int):
    """A ``write(fh)`` that writes ``limit`` bytes of a bigger state, then fails as a full disk does."""
    def write(fh):
        fh.write(b"x" * limit)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return write


def test_a_full_disk_mid_file_leaves_the_folder_as_it_was(tmp_path):
    folder = _folder(tmp_path)
    folder.save(1, lambda fh: fh.write(_payload(1)))
    before = _snapshot(folder.directory)
    with pytest.raises(CheckpointWriteError) as info:
        folder.save(2, _full_disk_after(1000))
    message = str(info.value)
    assert "\n" not in message
    assert f"could not write checkpoint {folder.path_for(2)}: No space left on device (ENOSPC)" in message
    assert "the previous checkpoint ckpt_00000001.pt is intact" in message
    assert _snapshot(folder.directory) == before  # no temporary, same manifest, same checkpoint
    assert folder.latest_valid() == folder.path_for(1)


def test_a_full_disk_while_recording_the_manifest_removes_the_new_file(tmp_path, monkeypatch):
    folder = _folder(tmp_path)
    folder.save(1, lambda fh: fh.write(_payload(1)))
    before = _snapshot(folder.directory)

    def no_room(entries):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(folder, "_write_manifest", no_room)
    with pytest.raises(CheckpointWriteError, match="ckpt_00000001.pt is intact"):
        folder.save(2, lambda fh: fh.write(_payload(2)))
    assert _snapshot(folder.directory) == before


def test_stale_temporaries_of_a_killed_writer_are_ignored_then_removed(tmp_path):
    folder = _folder(tmp_path)
    folder.save(1, lambda fh: fh.write(_payload(1)))
    stale = folder.directory / ".ckpt_00000002.pt.tmp12345"
    stale.write_bytes(b"half")  # what a SIGKILL during a write leaves
    assert folder.latest_valid() == folder.path_for(1)
    folder.save(3, lambda fh: fh.write(_payload(3)))
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
    folder = CheckpointFolder(tiny_tmpfs, keep_last=3, warn=lambda m: None)
    folder.save(1, lambda fh: torch.save({"w": torch.zeros(25_000)}, fh))
    before = _snapshot(tiny_tmpfs)
    with pytest.raises(CheckpointWriteError, match=r"No space left on device \(ENOSPC\); the previous checkpoint"):
        folder.save(2, lambda fh: torch.save({"w": torch.ones(40_000)}, fh))
    assert _snapshot(tiny_tmpfs) == before
    assert torch.equal(torch.load(folder.latest_valid())["w"], torch.zeros(25_000))


def test_training_checkpoints_fall_back_past_a_damaged_one_and_refuse_it_by_path(tmp_path, capsys):
    """The trainer's manager on one rank: auto skips the bad file; an explicit path to it is an error."""
    mg.init(backend="cpu", threads=1)
    manager = CheckpointManager(tmp_path / "checkpoints", keep_last=3)
    for step in (2, 4):
        manager.save({"step": step, "model": {"w": torch.full((3,), float(step))}, "optimizer": {}})
    newest = manager.path_for(4)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x10
    newest.write_bytes(bytes(data))
    assert find_latest(tmp_path / "checkpoints") == manager.path_for(2)
    assert manager.resolve("auto") == manager.path_for(2)
    assert "checksum mismatch" in capsys.readouterr().err
    with pytest.raises(CorruptCheckpointError, match=f"checkpoint {newest} is unusable: checksum mismatch"):
        manager.resolve(str(newest))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        with open(manager.path_for(2), "r+b") as fh:
            fh.truncate(100)
        check_checkpoint(manager.path_for(2))


def test_resume_from_a_damaged_file_is_one_line_exit_2_before_anything_starts(tmp_path, capsys):
    folder = CheckpointFolder(tmp_path / "old" / "checkpoints")
    folder.save(5, lambda fh: torch.save({"step": 5}, fh))
    bad = folder.path_for(5)
    with open(bad, "r+b") as fh:
        fh.truncate(50)
    run_dir = tmp_path / "run"
    code = main(["train", "-f", "nano", "--run-dir", str(run_dir), "--resume", str(bad)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"error: --resume {bad}: truncated: 50 bytes on disk") and "valid: an intact checkpoint" in err
    assert not run_dir.exists()
