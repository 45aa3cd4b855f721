"""Bad .npy and NIfTI inputs to `multigpu infer`: one line, exit 2, before anything is launched or written."""

from __future__ import annotations

import gzip
import sys
from unittest import mock

import numpy as np
import pytest

from multigpu.cli import main

nib = pytest.importorskip("nibabel")


def _nifti_bitpix_lies(path):
    nib.Nifti1Image(np.zeros((16, 16, 8), np.float32), np.eye(4)).to_filename(path)
    raw = bytearray(path.read_bytes())
    raw[72:74] = np.int16(16).tobytes()  # bitpix (offset 72): 16 bits for float32 data
    path.write_bytes(bytes(raw))


def _nifti_dims_lie(path):
    nib.Nifti1Image(np.zeros((16, 16, 8), np.float32), np.eye(4)).to_filename(path)
    raw = bytearray(path.read_bytes())
    raw[46:48] = np.int16(9).tobytes()  # dim[3] (offset 40 + 2 * 3): 9 slices claimed, 8 stored
    path.write_bytes(bytes(raw))


def _nifti_zero_pixdim_and_dims_lie(path):
    """A header nibabel fixes while loading it (pixdim 0), printing its own line, and that then fails our check."""
    _nifti_dims_lie(path)
    raw = bytearray(path.read_bytes())
    raw[80:84] = np.float32(0).tobytes()  # pixdim[1] (offset 76 + 4 * 1)
    path.write_bytes(bytes(raw))


def _truncated(path, write):
    write(path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])


def _nifti_gz(path):
    nib.Nifti1Image(np.zeros((16, 16, 8), np.float32), np.eye(4)).to_filename(path)


def _gz_truncated_inside(path):
    """A gzip stream cut short: the header still reads, the data ends early."""
    blob = nib.Nifti1Image(np.random.default_rng(0).random((16, 16, 8), np.float32), np.eye(4)).to_bytes()
    path.write_bytes(gzip.compress(blob)[:-2000])


BAD = [
    ("objects.npy", lambda p: np.save(p, np.array([{"a": 1}, None] * 8, dtype=object).reshape(4, 4)),
     "holds Python objects (dtype object)"),
    ("complex.npy", lambda p: np.save(p, np.zeros((16, 16), np.complex64)), "has dtype complex64; valid: a numeric"),
    ("line.npy", lambda p: np.save(p, np.zeros(64, np.float32)), "has shape (64,); valid: 2-D (H, W) or 3-D (D, H, W)"),
    ("video.npy", lambda p: np.save(p, np.zeros((2, 4, 16, 16), np.float32)), "has shape (2, 4, 16, 16); valid: 2-D"),
    ("cut.npy", lambda p: _truncated(p, lambda q: np.save(q, np.zeros((16, 16), np.float32))),
     "is truncated: its header says shape (16, 16) float32 (1,024 bytes of data) but the file holds 924"),
    ("notnumpy.npy", lambda p: p.write_bytes(b"\x93NUMPX garbage"), "cannot be read as a .npy array"),
    ("bitpix.nii", _nifti_bitpix_lies, "does not match its header: bitpix 16 for datatype float32 (32 bits)"),
    ("dims.nii", _nifti_dims_lie, "is truncated: its header says shape (16, 16, 9) float32"),
    ("pixdim.nii", _nifti_zero_pixdim_and_dims_lie, "is truncated: its header says shape (16, 16, 9) float32"),
    ("cut.nii", lambda p: _truncated(p, _nifti_gz), "is truncated: its header says shape (16, 16, 8) float32"),
    ("cut.nii.gz", _gz_truncated_inside, "is truncated or corrupt"),
    ("fourd.nii.gz", lambda p: nib.Nifti1Image(np.zeros((8, 8, 8, 3), np.float32), np.eye(4)).to_filename(p),
     "has shape (8, 8, 8, 3); valid: 2-D"),
    ("text.nii", lambda p: p.write_text("not a volume" * 40), "cannot be read as NIfTI"),
]


@pytest.mark.parametrize("name,make,message", BAD, ids=[b[0] for b in BAD])
def test_bad_array_or_volume_is_one_line_exit_2_before_anything_runs(tmp_path, capsys, monkeypatch, name, make, message):
    """nibabel's own logger writes to the stderr it found when it was imported (here pytest's, at collection):
    pointed at this test's, a line nibabel prints on its own is seen, as it is in a real process."""
    for handler in nib.imageglobals.logger.handlers:
        monkeypatch.setattr(handler, "stream", sys.stderr)
    make(tmp_path / name)
    argv = ["infer", "--input", str(tmp_path / name), "--model", "multigpu.infer.models:denoiser",
            "--model-arg", "channels=1", "--roi", "8", "--output", str(tmp_path / "out"), "--run-dir",
            str(tmp_path / "run")]
    with mock.patch("multigpu.launch.agent.launch") as launch:
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not launch.called
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("roi,message", [
    (["8", "8"], "roi=[8, 8] has 2 entries; the inputs have 3 spatial dims (give one value or 3)"),
    (["8"], "the model multigpu.infer.models:denoiser failed on a test window of shape (1, 1, 8, 8, 8)"),
    # issue 48: the built-in models are 2-D, and nothing said so
    (["8"], "; the built-in models (denoiser, edges, upsample2x) are 2-D: a volume needs a 3-D model of yours "
            "(--model pkg.module:factory)"),
    (["40"], "--roi 40 is larger than the largest input (16x16x8)"),
])
def test_a_volume_takes_3d_windows_and_a_2d_model_is_refused(tmp_path, capsys, roi, message):
    np.save(tmp_path / "vol.npy", np.zeros((16, 16, 8), np.float32))
    argv = ["infer", "--input", str(tmp_path / "vol.npy"), "--model", "multigpu.infer.models:denoiser",
            "--model-arg", "channels=1", "--roi", *roi, "--output", str(tmp_path / "out")]
    with mock.patch("multigpu.launch.agent.launch") as launch:
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not launch.called


def test_2d_and_3d_inputs_in_one_run_are_refused(tmp_path, capsys):
    np.save(tmp_path / "vol.npy", np.zeros((16, 16, 8), np.float32))
    np.save(tmp_path / "slice.npy", np.zeros((16, 16), np.float32))
    argv = ["infer", "--input", str(tmp_path / "vol.npy"), str(tmp_path / "slice.npy"), "--roi", "8"]
    with mock.patch("multigpu.launch.agent.launch"):
        assert main(argv) == 2
    assert "the inputs mix 2-D images and 3-D volumes" in capsys.readouterr().err
