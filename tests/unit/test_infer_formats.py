""".npy arrays and NIfTI volumes in and out of `multigpu infer`: mapped reads, outputs in the input's format."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from multigpu.infer import formats, io

nib = pytest.importorskip("nibabel")


def _affine():
    affine = np.diag([0.5, 0.7, 2.0, 1.0])
    affine[:3, 3] = [10.0, -5.0, 3.0]
    return affine


@pytest.mark.parametrize("dtype", ["float32", "int16", "uint8"])
def test_npy_is_read_from_the_map_not_loaded(tmp_path, dtype):
    path = tmp_path / "big.npy"
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(64, 512, 512))  # 16-64 MiB
    array[3, 100:110, 200:210] = 7
    array.flush()
    del array
    tracemalloc.start()  # numpy reports its allocations to tracemalloc; a map allocates nothing
    try:
        image = io.read_image(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak:,} bytes allocated: the array was loaded, not mapped"
    assert image.shape == (1, 1, 64, 512, 512) and image.dtype == getattr(torch, dtype)
    window = image[0, :, 2:5, 96:112, 196:212].float()  # what a rank cuts: a window, read from the map
    assert window.sum() == 7 * 100 and io.probe(path).size == (64, 512, 512)


def test_uncompressed_nifti_is_read_from_the_map_and_keeps_its_axes(tmp_path):
    data = np.random.default_rng(0).integers(-1000, 1000, (40, 30, 20), dtype=np.int16)
    nib.Nifti1Image(data, _affine()).to_filename(tmp_path / "ct.nii")
    nib.Nifti1Image(data, _affine()).to_filename(tmp_path / "ct.nii.gz")
    tracemalloc.start()
    try:
        mapped = io.read_image(tmp_path / "ct.nii")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < data.nbytes // 2, f"{peak:,} bytes allocated for a {data.nbytes:,}-byte volume"
    packed = io.read_image(tmp_path / "ct.nii.gz")  # gzip: read whole
    for image in (mapped, packed):
        assert image.shape == (1, 1, 40, 30, 20)  # (X, Y, Z), as nibabel and MONAI's NibabelReader give it
        assert np.array_equal(image[0, 0].numpy(), data)


def test_scaled_and_float64_volumes_are_read_as_float32_values(tmp_path):
    data = np.arange(24, dtype=np.int16).reshape(4, 6)
    image = nib.Nifti1Image(data, np.eye(4))
    image.header.set_slope_inter(0.5, -3.0)
    image.to_filename(tmp_path / "scaled.nii")
    np.save(tmp_path / "f64.npy", np.linspace(0, 1, 24).reshape(4, 6))
    scaled = io.read_image(tmp_path / "scaled.nii")
    assert scaled.dtype == torch.float32 and torch.equal(scaled[0, 0], torch.from_numpy(data * 0.5 - 3.0).float())
    f64 = io.read_image(tmp_path / "f64.npy")
    assert f64.dtype == torch.float32 and f64.shape == (1, 1, 4, 6)


def test_npy_output_is_npy_in_the_input_layout(tmp_path):
    np.save(tmp_path / "slice.npy", np.zeros((12, 10), np.float32))
    target = io.output_path(tmp_path / "out", tmp_path / "slice.npy")
    assert target == tmp_path / "out" / "slice.npy"
    out = torch.randn(1, 1, 12, 10)
    io.write_image(target, out, source=tmp_path / "slice.npy")
    assert np.array_equal(np.load(target), out[0, 0].numpy())  # one channel: (H, W), as the input
    io.write_image(target, torch.randn(1, 3, 12, 10), source=tmp_path / "slice.npy")
    assert np.load(target).shape == (3, 12, 10)  # several: channel first
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["slice.npy"]  # nothing temporary left


@pytest.mark.parametrize("name", ["ct.nii", "ct.nii.gz"])
def test_nifti_output_keeps_the_affine_and_header(tmp_path, name):
    image = nib.Nifti1Image(np.zeros((8, 6, 4), np.int16), _affine())
    image.header["descrip"] = b"scanner 7"
    image.header.set_xyzt_units("mm", "sec")
    image.to_filename(tmp_path / name)
    target = io.output_path(tmp_path / "out", tmp_path / name)
    assert target.name == name
    out = torch.randn(1, 1, 8, 6, 4)
    io.write_image(target, out, source=tmp_path / name)
    written = nib.load(target)
    assert written.get_data_dtype() == np.float32 and written.shape == (8, 6, 4)
    assert np.array_equal(written.affine, nib.load(tmp_path / name).affine)  # as stored (float32)
    for key in ("descrip", "xyzt_units", "qform_code", "sform_code", "pixdim"):
        assert np.array_equal(written.header[key], image.header[key]), key
    assert np.array_equal(np.asarray(written.dataobj), out[0, 0].numpy())


def test_nifti_upsampled_output_has_smaller_voxels_in_the_same_place(tmp_path):
    nib.Nifti1Image(np.zeros((8, 6, 4), np.float32), _affine()).to_filename(tmp_path / "ct.nii")
    io.write_image(tmp_path / "up.nii", torch.zeros(1, 1, 16, 12, 8), source=tmp_path / "ct.nii")
    written = nib.load(tmp_path / "up.nii")
    assert written.header.get_zooms() == pytest.approx((0.25, 0.35, 1.0))
    corner = lambda affine: affine[:3, :3] @ [-0.5, -0.5, -0.5] + affine[:3, 3]  # noqa: E731 - the volume's corner
    assert corner(written.affine) == pytest.approx(corner(_affine()))


def test_a_2d_nifti_with_a_third_axis_of_one_is_2d_and_written_back_so(tmp_path):
    nib.Nifti1Image(np.ones((9, 7, 1), np.float32), np.eye(4)).to_filename(tmp_path / "slice.nii")
    assert io.probe(tmp_path / "slice.nii").size == (9, 7) and io.read_image(tmp_path / "slice.nii").shape == (1, 1, 9, 7)
    io.write_image(tmp_path / "o.nii", torch.ones(1, 1, 9, 7), source=tmp_path / "slice.nii")
    assert nib.load(tmp_path / "o.nii").shape == (9, 7, 1)


def test_formats_handles_only_its_suffixes():
    assert all(formats.handles(p) for p in ("a.npy", "a.NII", "b.nii.gz"))
    assert not any(formats.handles(p) for p in ("a.png", "a.gz", "a.npz", "a.tif"))
