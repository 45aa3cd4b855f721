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


# ----------------------------------------------------------------------------- what reading costs, decompression bombs
_MEASURE = """
import sys
from multigpu.infer import io

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

for path in sys.argv[1:]:
    info = io.probe(path)
    base = status("VmRSS:")
    open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
    image = io.read_image(path)
    print(status("VmHWM:") - base, info.read_bytes(), image.numel() * 4)
    del image
"""
_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}
"""glibc's default, held: large blocks stay mapped apart and go back to the system when freed (its adaptive threshold
would keep the first read's blocks in the heap, and the second read would reuse them unseen)."""

_MODES = {"RGB": 3, "L": 1, "RGBA": 4}
_SMALL, _LARGE = 500, 1500
"""Rows of 2000 pixels. The small image is read first in a fresh process: its peak holds what the decoder pages in
once, whatever the size (1.2 to 4.3 MB, depending on the machine); the large one then costs its pixels alone."""


@pytest.fixture(scope="module")
def _read_peaks(tmp_path_factory) -> dict:
    """``{(mode, rows): (peak, counted, result)}``: peak RSS of read_image, the small image then the large one in
    a fresh process per mode, all three started at once (random pixels: nothing compresses in memory)."""
    import os
    import subprocess
    import sys

    from PIL import Image

    folder = tmp_path_factory.mktemp("peaks")
    rng = np.random.default_rng(0)
    procs = {}
    for mode, channels in _MODES.items():
        paths = []
        for rows in (_SMALL, _LARGE):
            pixels = rng.integers(0, 255, (rows, 2000, channels), dtype=np.uint8)
            paths.append(folder / f"{mode}_{rows}.png")
            Image.fromarray(pixels[:, :, 0] if mode == "L" else pixels, mode).save(paths[-1])
        procs[mode] = subprocess.Popen([sys.executable, "-c", _MEASURE, *map(str, paths)], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env={**os.environ, **_MALLOC})
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        small, large = stdout.splitlines()
        out[mode, _SMALL], out[mode, _LARGE] = tuple(map(int, small.split())), tuple(map(int, large.split()))
    return out


@pytest.mark.parametrize("mode", list(_MODES))
def test_reading_an_image_peaks_within_what_the_launcher_counts(_read_peaks, mode):
    """Never under-counted: a fresh process's first read, the decoder's one-off paging included; and the count's
    part that grows with the image (all but io.READ_FIXED_BYTES) covers what a read peaks at for its pixels, with
    at most 25% to spare. The old read peaked at 31 B/px for RGB where the launcher counted the float32 result,
    12 B/px. The old bound, the whole count within 1.25 times the first read's peak, failed on a machine whose
    decoder paged in less than the fixed allowance (grey, 3 Mpx: counted 7.3 B/px, peak 5.4)."""
    peak, counted, _ = _read_peaks[mode, _SMALL]
    assert peak <= counted, f"{mode}: the first read peaked at {peak / 1e6:.1f} MB, counted {counted / 1e6:.1f} MB"
    peak, counted, result = _read_peaks[mode, _LARGE]
    pixels = 2000 * _LARGE
    grows = counted - io.READ_FIXED_BYTES
    assert peak <= grows <= 1.25 * max(peak, result), (
        f"{mode}: counted {grows / pixels:.2f} B/px, peak {peak / pixels:.2f} B/px")


def test_the_values_read_are_the_same_bits_as_before(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(1)
    for mode, array in [("RGB", rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)),
                        ("I;16", rng.integers(0, 65535, (40, 30), dtype=np.uint16))]:
        Image.fromarray(array).save(tmp_path / "v.png")
        scale = 255.0 if array.dtype == np.uint8 else 65535.0
        before = (array.astype(np.float32) / scale).reshape(40, 30, -1).transpose(2, 0, 1)  # the old read
        assert torch.equal(io.read_image(tmp_path / "v.png")[0], torch.from_numpy(np.ascontiguousarray(before))), mode


def test_a_decompression_bomb_is_refused_from_its_header_unless_the_guard_is_off(tmp_path):
    from PIL import Image

    from tests.payloads import png_bomb

    cap = Image.MAX_IMAGE_PIXELS
    bomb = png_bomb(tmp_path / "bomb.png", 12000)
    for read in (io.probe, io.read_image):
        with pytest.raises(ConfigError) as info:
            read(bomb)
        message = str(info.value)
        assert message.startswith(f"input '{bomb}' is 12000x12000 and would decode to 412 MiB from a ") and (
            "more than max_decode_ratio=100): a decompression bomb" in message and "max_decode_ratio=0" in message)
    assert io.probe(bomb, max_decode_ratio=0).size == (12000, 12000)  # the explicit opt-out
    assert io.probe(png_bomb(tmp_path / "flat.png", 2000)).size == (2000, 2000)  # 12 MB: too small to be a bomb
    assert cap == Image.MAX_IMAGE_PIXELS  # Pillow's own guard is never lifted for the whole process


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_an_image_file_cut_short_is_refused_from_the_launcher_naming_it(tmp_path, suffix):
    """A PNG cut in half is refused by the launcher, naming it; a header check alone let it through to fail in
    the ranks ("OSError: image file is truncated", exit 1, no file named)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    whole = tmp_path / f"whole{suffix}"
    Image.fromarray(rng.integers(0, 255, (64, 48, 3), dtype=np.uint8)).save(whole)
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert io.probe(whole).size == (64, 48) and io.read_image(whole).shape == (1, 3, 64, 48)
    for read in (io.probe, io.read_image):
        with pytest.raises(ConfigError) as info:
            read(cut)
        message = str(info.value)
        assert message.startswith(f"input '{cut}' is cut short or damaged (") and message.endswith(
            f"valid: a complete {'PNG' if suffix == '.png' else 'JPEG'} file (copy or write it again)"), message
