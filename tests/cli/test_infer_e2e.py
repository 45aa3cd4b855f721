"""`multigpu infer` end to end: 2 real CPU ranks write the same output, bit for bit, as 1 rank."""

from __future__ import annotations

import json

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
