"""`multigpu infer` on .npy arrays and NIfTI volumes end to end: 2 real CPU ranks write the 1-rank output bit for
bit, in the input's format, and the 1-rank output of a .npy volume is MONAI's sliding_window_inference."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.e2e
nib = pytest.importorskip("nibabel")
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}


def smooth3d() -> torch.nn.Module:
    """A fixed 3-D filter (a model factory for the command line): its output depends on every neighbour."""
    conv = torch.nn.Conv3d(1, 1, 3, padding=1, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.arange(1.0, 28.0).reshape(1, 1, 3, 3, 3) / 378)
    return conv.eval()


def _affine():
    affine = np.diag([0.8, 0.8, 2.5, 1.0])
    affine[:3, 3] = [-90.0, 40.0, 12.0]
    return affine


def _run(tmp_path, name, nproc, inputs, *model):
    out = tmp_path / f"{name}{nproc}"
    proc = run_cli("infer", *model, "--input", *map(str, inputs), "--output", str(out), "--run-dir",
                   str(tmp_path / f"run_{name}{nproc}"), "--roi", "12", "--overlap", "0.25", "--batch-size", "3",
                   "--blend", "gaussian", "--nproc-per-node", str(nproc), env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"on {nproc} rank(s)" in proc.stdout
    return out


def _one_rank_in_process(tmp_path, name, inputs, factory, capsys):
    """The 1-rank reference: the rank's own entry point (the infer workload's main) called in this process, with
    the threads a 1-rank launch gives its rank (``OMP_NUM_THREADS`` where set, else every core): the output on
    any number of ranks is bitwise the 1-rank output where the threads are the same (multigpu/infer/sliding.py)."""
    from multigpu.factory import Factory
    from multigpu.infer import job
    from multigpu.infer.config import InferConfig
    from multigpu.runtime.context import RunContext
    from multigpu.runtime.env import cpu_count

    out = tmp_path / f"{name}1"
    cfg = InferConfig(model=Factory(factory=factory), inputs=list(map(str, inputs)), output=str(out), roi=[12],
                      overlap=[0.25], batch_size=3, blend="gaussian")
    threads, grad = torch.get_num_threads(), torch.is_grad_enabled()  # a rank's settings: this process's back after
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or cpu_count()))
    try:
        assert job.main(cfg, RunContext(run_dir=str(tmp_path / f"run_{name}1"))) == 0
    finally:
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
    assert "on 1 rank(s)" in capsys.readouterr().out
    return out


def test_volumes_get_3d_windows_and_two_ranks_write_the_one_rank_output(tmp_path, capsys):
    rng = np.random.default_rng(3)
    volume = rng.normal(size=(30, 26, 20)).astype(np.float32)
    np.save(tmp_path / "volume.npy", volume)
    ct = rng.integers(-1000, 1500, (28, 24, 18), dtype=np.int16)
    nib.Nifti1Image(ct, _affine()).to_filename(tmp_path / "ct.nii.gz")
    model = ["--model", "tests.cli.test_infer_formats_e2e:smooth3d"]
    inputs = [tmp_path / "volume.npy", tmp_path / "ct.nii.gz"]
    runs = {1: _one_rank_in_process(tmp_path, "vol", inputs, model[1], capsys), 2: _run(tmp_path, "vol", 2, inputs, *model)}
    npy = {n: np.load(runs[n] / "volume.npy") for n in runs}
    nii = {n: nib.load(runs[n] / "ct.nii.gz") for n in runs}
    assert npy[1].shape == (30, 26, 20) and npy[1].dtype == np.float32
    assert np.array_equal(npy[1], npy[2])  # bitwise on 1 and 2 ranks
    assert nii[1].shape == (28, 24, 18) and nii[1].get_data_dtype() == np.float32
    assert np.array_equal(nii[1].get_fdata(), nii[2].get_fdata())
    assert np.array_equal(nii[1].affine, nib.load(tmp_path / "ct.nii.gz").affine)

    # the same volume through MONAI's own sliding window, one process: the same result
    inferers = pytest.importorskip("monai.inferers")
    with torch.inference_mode():
        theirs = inferers.sliding_window_inference(torch.from_numpy(np.load(tmp_path / "volume.npy"))[None, None],
                                                   12, 3, smooth3d(), 0.25, "gaussian")
    theirs = theirs.as_tensor() if hasattr(theirs, "as_tensor") else theirs
    torch.testing.assert_close(torch.from_numpy(npy[1]), theirs[0, 0], rtol=1e-5, atol=1e-6)  # (a Conv3d: 3-D windows)


def test_2d_arrays_and_slices_two_ranks_write_the_one_rank_output(tmp_path):
    rng = np.random.default_rng(4)
    np.save(tmp_path / "slice.npy", rng.random((50, 40), dtype=np.float32))
    nib.Nifti1Image(rng.random((44, 36, 1), dtype=np.float32), _affine()).to_filename(tmp_path / "slice2.nii")
    model = ["--model", "multigpu.infer.models:denoiser", "--model-arg", "channels=1"]
    runs = {n: _run(tmp_path, "img", n, [tmp_path / "slice.npy", tmp_path / "slice2.nii"], *model) for n in (1, 2)}
    one, two = (np.load(runs[n] / "slice.npy") for n in (1, 2))
    assert one.shape == (50, 40) and np.array_equal(one, two)
    one, two = (nib.load(runs[n] / "slice2.nii") for n in (1, 2))
    assert one.shape == (44, 36, 1) and np.array_equal(np.asarray(one.dataobj), np.asarray(two.dataobj))
    assert (runs[1] / "slice2.nii").read_bytes() == (runs[2] / "slice2.nii").read_bytes()
