"""Outputs written into a folder another user controls never follow a link they planted (issue 48, critical 2).

Every whole-file write went through a temporary beside the target with a predictable name (``.<name>.tmp<pid>``),
opened with a plain ``open``, which follows a symlink: with links planted at the names of the next pids in an
``--output`` folder owned by ``nobody``, root's ``infer`` overwrote a 0600 root file. Each test plants links at every
name the writer could pick and checks that the file they point at is left as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from multigpu.files import atomic_path, write_json_atomic, write_text_atomic

SECRET = "root's own, 0600"


def _secret(tmp_path: Path) -> Path:
    secret = tmp_path / "elsewhere" / "secret"
    secret.parent.mkdir()
    secret.write_text(SECRET)
    secret.chmod(0o600)
    return secret


def _plant(folder: Path, target: str, secret: Path, pids) -> None:
    """Links to ``secret`` at the temporary names a writer of ``folder/target`` with one of ``pids`` used, and at the
    target itself."""
    stem, suffix = os.path.splitext(target)
    for pid in pids:
        for name in (f".{target}.tmp{pid}", f".{stem}.tmp{pid}{suffix}"):
            if not (folder / name).is_symlink():
                (folder / name).symlink_to(secret)
    (folder / target).symlink_to(secret)


def _untouched(secret: Path) -> None:
    assert secret.read_text() == SECRET and secret.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("keep_suffix", [False, True])
def test_an_atomic_write_never_follows_a_link_at_its_temporary_or_its_target(tmp_path, keep_suffix):
    secret = _secret(tmp_path)
    folder = tmp_path / "theirs"
    folder.mkdir()
    for name in ("a.json", "b.txt", "c.png"):
        _plant(folder, name, secret, [os.getpid()])
    write_json_atomic(folder / "a.json", {"x": 1})
    write_text_atomic(folder / "b.txt", "mine")
    with atomic_path(folder / "c.png", keep_suffix=keep_suffix) as tmp:
        assert tmp.name.endswith(".png") or not keep_suffix
        with open(tmp, "w") as fh:
            fh.write("pixels")
    _untouched(secret)
    for name, text in (("a.json", '{\n  "x": 1\n}'), ("b.txt", "mine"), ("c.png", "pixels")):
        assert not (folder / name).is_symlink() and (folder / name).read_text() == text  # the link was replaced
    made = {p.name for p in folder.iterdir() if not p.is_symlink()}
    assert made == {"a.json", "b.txt", "c.png"}  # no temporary left behind


def test_a_temporary_swapped_for_a_link_while_it_is_written_still_writes_only_the_writers_own_file(tmp_path):
    """The owner of the folder can rename or replace any entry in it at any time (it is theirs): a temporary found by
    its name the moment after it was made, and swapped for a link (or a folder of links), must not be followed."""
    secret = _secret(tmp_path)
    folder = tmp_path / "theirs"
    folder.mkdir()
    with atomic_path(folder / "out.png", keep_suffix=True) as tmp:
        for entry in list(folder.iterdir()):  # what an attacker watching the folder (inotify) does
            if entry.is_dir() and not entry.is_symlink():
                entry.rename(folder / "moved-away")
                entry.mkdir()
                for name in {"out.png", tmp.name}:
                    (entry / name).symlink_to(secret)
            else:
                entry.unlink()
                entry.symlink_to(secret)
        if tmp.parent == folder and not tmp.is_symlink():  # a name in the folder itself, known: planted there too
            tmp.symlink_to(secret)
        with open(tmp, "w") as fh:
            fh.write("pixels")
    _untouched(secret)
    assert (folder / "out.png").read_text() == "pixels" and not (folder / "out.png").is_symlink()


def test_report_o_into_a_folder_with_planted_links_leaves_their_target_alone(tmp_path, capsys):
    """``multigpu report RUN -o /shared/r.html`` (in this process: its pid is the writer's)."""
    pytest.importorskip("matplotlib")
    from multigpu.cli import main
    from tests.unit.test_report import make_bench_dir

    secret = _secret(tmp_path)
    make_bench_dir(tmp_path / "bench")
    shared = tmp_path / "shared"
    shared.mkdir()
    _plant(shared, "r.html", secret, [os.getpid()])
    assert main(["report", str(tmp_path / "bench"), "-o", str(shared / "r.html")]) == 0
    _untouched(secret)
    assert "Scaling (strong)" in (shared / "r.html").read_text() and not (shared / "r.html").is_symlink()


def test_the_run_folder_lock_is_taken_without_following_a_planted_link(tmp_path):
    from multigpu.launch import rundir

    secret = _secret(tmp_path)
    folder = tmp_path / "run"
    folder.mkdir()
    lock = folder / rundir.lock_name(0)
    for pid in [os.getpid()]:
        (folder / f"{lock.name}.tmp{pid}").symlink_to(secret)
    assert rundir._try_take(lock, {"pid": os.getpid()}) and not rundir._try_take(lock, {"pid": 1})
    _untouched(secret)
    assert json.loads(lock.read_text()) == {"pid": os.getpid()} and not lock.is_symlink()


@pytest.mark.e2e
def test_infer_output_into_a_folder_with_links_planted_for_the_next_pids_leaves_their_target_alone(tmp_path):
    """The issue's reproduction: links at ``.<stem>.tmp<pid><suffix>`` for the next 4,000 pids in the ``--output``
    folder, and at the output's own name."""
    image = pytest.importorskip("PIL.Image")
    import numpy as np

    from tests.conftest import run_cli

    secret = _secret(tmp_path)
    png = tmp_path / "photo.png"
    image.fromarray((np.random.default_rng(1).random((64, 48, 3)) * 255).astype(np.uint8)).save(png)
    shared = tmp_path / "shared"
    shared.mkdir()
    last = int(Path("/proc/sys/kernel/ns_last_pid").read_text())
    _plant(shared, "photo.png", secret, range(last + 1, last + 4001))
    proc = run_cli("infer", "--model", "multigpu.infer.models:denoiser", "--input", str(png), "--output", str(shared),
                   "--run-dir", str(tmp_path / "run"), "--roi", "32", "--nproc-per-node", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    _untouched(secret)
    out = shared / "photo.png"
    assert not out.is_symlink() and image.open(out).size == (48, 64)
