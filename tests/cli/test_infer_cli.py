"""`multigpu infer` input checks in the launcher: one line, exit 2, nothing written, nothing launched."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

from multigpu.cli import main
from tests.conftest import run_file

PIL = pytest.importorskip("PIL.Image")


@pytest.fixture
def images(tmp_path):
    rng = np.random.default_rng(0)
    rgb = tmp_path / "rgb.png"
    PIL.fromarray((rng.random((64, 80, 3)) * 255).astype(np.uint8)).save(rgb)
    gray = tmp_path / "gray.png"
    PIL.fromarray((rng.random((40, 40)) * 255).astype(np.uint8)).save(gray)
    return {"rgb": str(rgb), "gray": str(gray), "tmp": tmp_path}


def _infer(images, *extra, model="multigpu.infer.models:denoiser", inputs=None):
    tmp = images["tmp"]
    return ["infer", "--model", model, "--input", *(inputs or [images["rgb"]]), "--output", str(tmp / "out"),
            "--run-dir", str(tmp / "run"), "--roi", "32", *extra]


BAD = [
    ({"inputs": ["missing.png"]}, [], "missing.png' does not exist"),
    ({}, ["--roi", "128"], "--roi 128 is larger than the largest input (64x80)"),
    ({}, ["--overlap", "1.0"], "infer.overlap=[1.0] must be in [0, 1)"),
    ({}, ["--overlap", "-0.5"], "must be in [0, 1)"),
    ({"model": "no_such_pkg.models:net"}, [], "module 'no_such_pkg.models' does not import"),
    ({"model": "multigpu.infer.models:nope"}, [], "has no callable 'nope'; callables there:"),
    ({"model": "denoiser"}, [], "must look like package.module:factory"),
    ({"inputs": ["gray"]}, [], "has 1 channel(s) but the model multigpu.infer.models:denoiser takes 3"),
    ({"inputs": ["rgb", "gray"]}, [], "the inputs have different channel counts"),
    ({"inputs": ["notes.txt"]}, [], "unsupported type '.txt'"),
    ({}, ["--set", "batch_sise=4"], "Did you mean 'infer.batch_size'?"),
    ({}, ["--gpus", "3"], ""),  # no GPUs here: a device error, still exit 2
]


@pytest.mark.parametrize("change,extra,message", BAD)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(images, capsys, change, extra, message):
    (images["tmp"] / "notes.txt").write_text("not an image")
    inputs = [images.get(i, str(images["tmp"] / i)) for i in change.get("inputs", ["rgb"])]
    argv = _infer(images, *extra, model=change.get("model", "multigpu.infer.models:denoiser"), inputs=inputs)
    with mock.patch("multigpu.launch.agent.launch") as launch:
        code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err
    assert not launch.called
    assert not (images["tmp"] / "out").exists() and not (images["tmp"] / "run").exists()


def test_a_broken_image_file_is_reported(images, capsys):
    broken = images["tmp"] / "broken.png"
    broken.write_bytes(b"\x89PNG not really")
    assert main(_infer(images, inputs=[str(broken)])) == 2
    assert "cannot be read as an image" in capsys.readouterr().err


def test_good_input_writes_the_run_file_and_launches_the_rank_entry_point(images):
    seen = []
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=lambda *a: seen.append((a, run_file()))):
        code = main(_infer(images, "--overlap", "0.5", "--blend", "constant", "--batch-size", "3",
                           "--precision", "bf16", "--nproc-per-node", "2", "--set", "sigma_scale=0.2"))
    assert code == 0
    (torch_cfg, _, args), data = seen[0]
    assert args[-2:] == ["-m", "multigpu.jobs.rank"] and torch_cfg.nproc_per_node == 2
    resolved = data["config"]
    assert data["workload"] == "infer" and data["run"]["run_dir"] == str((images["tmp"] / "run").resolve())
    assert resolved["roi"] == [32] and resolved["overlap"] == [0.5] and resolved["batch_size"] == 3
    assert resolved["blend"] == "constant" and resolved["precision"] == "bf16" and resolved["sigma_scale"] == 0.2
    assert resolved["inputs"] == [images["rgb"]] and resolved["output"] == str(images["tmp"] / "out")
