"""`multigpu infer` end to end: 2 real CPU ranks write the same output, bit for bit, as 1 rank."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def test_two_ranks_write_exactly_the_one_rank_output(tmp_path):
    tifffile = pytest.importorskip("tifffile")
    image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(1)
    tif = tmp_path / "volume_slice.tif"
    tifffile.imwrite(tif, rng.random((150, 130, 3), dtype=np.float32), photometric="rgb")
    png = tmp_path / "photo.png"
    image.fromarray((rng.random((90, 70, 3)) * 255).astype(np.uint8)).save(png)
    outputs = {}
    for nproc in ("1", "2"):
        proc = run_cli("infer", "--model", "multigpu.infer.models:denoiser", "--input", str(tif), str(png),
                       "--output", str(tmp_path / f"out{nproc}"), "--run-dir", str(tmp_path / f"run{nproc}"),
                       "--roi", "32", "--overlap", "0.25", "--batch-size", "4", "--blend", "gaussian",
                       "--nproc-per-node", nproc)
        assert proc.returncode == 0, proc.stderr
        assert f"on {nproc} rank(s)" in proc.stdout
        summary = json.loads((tmp_path / f"run{nproc}" / "summary.json").read_text())
        assert summary["unit"] == "windows" and summary["world_size"] == int(nproc)
        assert summary["num_windows"] == 36 + 12  # 6 x 6 windows of the TIFF, 4 x 3 of the PNG
        outputs[nproc] = (tifffile.imread(tmp_path / f"out{nproc}" / "volume_slice.tif"),
                          (tmp_path / f"out{nproc}" / "photo.png").read_bytes())
    assert outputs["1"][0].shape == (150, 130, 3) and outputs["1"][0].dtype == np.float32
    assert np.array_equal(outputs["1"][0], outputs["2"][0])  # float32 TIFF: bitwise
    assert outputs["1"][1] == outputs["2"][1]  # PNG: byte for byte
    # the outputs the user named get the user's umask; the run folder's own files stay private (0600)
    umask = os.umask(0)
    os.umask(umask)
    out = tmp_path / "out2"
    assert {p.name: p.stat().st_mode & 0o777 for p in [out, *out.iterdir()]} == {
        "out2": 0o777 & ~umask, "volume_slice.tif": 0o666 & ~umask, "photo.png": 0o666 & ~umask}
    assert (tmp_path / "run2" / "summary.json").stat().st_mode & 0o777 == 0o600


def shifted_denoiser(shift: float = 0.0):
    """A model factory with an argument that returns a closure (not an nn.Module) holding a module, whose calls
    take an extra argument, as DeepInverse's DRUNet takes (x, sigma)."""
    from multigpu.infer.models import denoiser

    net = denoiser()

    def model(x, sigma):
        return net(x) + shift + sigma

    return model


def test_a_factory_argument_a_closure_and_a_call_argument_through_the_command_line(tmp_path):
    import os

    from tests.conftest import ROOT

    image = pytest.importorskip("PIL.Image")
    png = tmp_path / "photo.png"
    image.fromarray((np.random.default_rng(2).random((60, 80, 3)) * 100).astype(np.uint8)).save(png)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    outputs = {}
    for name, extra in (("plain", ["--model", "multigpu.infer.models:denoiser"]),
                        ("shifted", ["--model", "tests.cli.test_infer_e2e:shifted_denoiser", "--model-arg",
                                     "shift=0.25", "--call-arg", "sigma=0.125"])):
        proc = run_cli("infer", *extra, "--input", str(png), "--output", str(tmp_path / name), "--roi", "32",
                       "--blend", "crop", "--nproc-per-node", "2", "--run-dir", str(tmp_path / f"run_{name}"), env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[name] = np.asarray(image.open(tmp_path / name / "photo.png"), dtype=np.int32)
    # the closure added 0.25 + 0.125 of full scale to every pixel: 95.6 of 255 (each side rounded to 8 bits)
    diff = np.abs(outputs["shifted"] - np.clip(outputs["plain"] + 0.375 * 255, 0, 255))
    assert diff.max() <= 1.0 and outputs["shifted"].mean() > outputs["plain"].mean() + 90, diff.max()
