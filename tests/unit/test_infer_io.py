"""Image files in and out of `multigpu infer`, and the demo models' behaviour without weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.infer import io
from multigpu.infer.models import denoiser, edges, noisy_demo_image, upsample2x

pytest.importorskip("PIL.Image")


def test_png_and_tiff_round_trip(tmp_path):
    pytest.importorskip("tifffile")
    rgb = torch.rand(3, 20, 30)
    io.write_image(tmp_path / "a.png", rgb)
    back = io.read_image(tmp_path / "a.png")
    assert back.shape == (1, 3, 20, 30) and (back[0] - rgb).abs().max() <= 0.5 / 255 + 1e-6
    assert io.probe(tmp_path / "a.png").channels == 3 and io.probe(tmp_path / "a.png").size == (20, 30)
    gray = torch.randn(1, 7, 9)  # TIFF keeps float32 values as they are, unclipped
    io.write_image(tmp_path / "b.tif", gray)
    assert torch.equal(io.read_image(tmp_path / "b.tif")[0], gray)
    assert io.probe(tmp_path / "b.tif").channels == 1
    assert io.output_path("out", "x/photo.jpg").name == "photo.png" and io.output_path("o", "s.TIFF").suffix == ".tif"
    assert not list(tmp_path.glob(".*tmp*"))  # atomic writes leave no temporary file
    with pytest.raises(ConfigError, match="cannot write 2 channels as PNG"):
        io.write_image(tmp_path / "c.png", torch.zeros(2, 4, 4))


def test_demo_models_mean_something_without_weights(tmp_path):
    step = torch.zeros(1, 3, 16, 16)
    step[..., 8:] = 1.0
    e = edges()(step)
    assert e.shape == (1, 1, 16, 16) and e[0, 0, :, 7:9].min() > 0.4 and e[0, 0, :, :6].abs().max() < 1e-6
    noisy = 0.5 + 0.1 * torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert denoiser()(noisy).std() < 0.5 * noisy.std()  # noise is smoothed away
    assert upsample2x()(noisy).shape == (1, 3, 64, 64)
    path = noisy_demo_image(tmp_path / "demo.png")
    assert io.probe(path).channels == 3 and min(io.probe(path).size) >= 256
    assert np.asarray(io.read_image(path)).std() > 0.05
