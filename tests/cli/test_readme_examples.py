"""The README's examples run: its Python blocks and the commands that point at examples/ (as a user copies them)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import ROOT, run_cli
from tests.docs.markdown import bash_line, python_block

README_PATH = ROOT / "README.md"
README = README_PATH.read_text()


def _python_block(containing: str) -> str:
    return python_block(README_PATH, containing)


def _bash_line(starting: str) -> list[str]:
    """A README command (joined across its backslash continuations), as argv after `multigpu`."""
    return bash_line(README_PATH, starting)


def _user_package(tmp_path, module: str, block_containing: str) -> dict[str, str]:
    """``tmp_path/mypkg/<module>.py`` holding the README block, as a user copies it; the env that imports it."""
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / f"{module}.py").write_text(_python_block(block_containing))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}


def test_the_monai_swap_block_gives_monais_output():
    monai = pytest.importorskip("monai.inferers", reason="monai is not installed")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.Tanh()).eval()
    scope = {"image": torch.rand(1, 1, 300, 280), "net": net}
    with torch.no_grad():
        exec(_python_block("from multigpu.infer import sliding_window_inference"), scope)  # noqa: S102
        theirs = monai.sliding_window_inference(scope["image"], (256, 256), 8, net, 0.25, "gaussian",
                                                padding_mode="replicate")
    assert torch.allclose(scope["out"], theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
def test_the_workload_block_runs_through_multigpu_run(tmp_path):
    env = _user_package(tmp_path, "count", "WORKLOAD = Workload(")
    argv = _bash_line("multigpu run mypkg.count:WORKLOAD")
    proc = run_cli(*argv, "--run-dir", str(tmp_path / "run"), env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sum of 0..4999 = 12497500 on 2 rank(s)" in proc.stdout


@pytest.mark.e2e
def test_the_env_factory_block_trains_through_multigpu_rl(tmp_path):
    """The README's ``mypkg/envs.py`` (gymnasium's own vector env) and its ``multigpu rl --env`` command, on its
    2 ranks, with its env.kwargs and --obs-norm; shortened to 4 updates (its target needs 2M env-steps)."""
    pytest.importorskip("gymnasium")
    env = _user_package(tmp_path, "envs", "def make_env(num_envs, seed, device, autoreset_mode")
    argv = _bash_line("multigpu rl --env mypkg.envs:make_env")
    proc = run_cli(*argv, "total_env_steps=2048", "num_envs=8", "num_steps=64", "num_minibatches=2", "update_epochs=1",
                   "--run-dir", str(tmp_path / "run"), env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((tmp_path / "run" / "run.json").read_text())["config"]
    assert config["env"] == {"factory": "mypkg.envs:make_env", "kwargs": {"name": "MountainCarContinuous-v0"}}
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["rl"]["updates"] == 4
    assert summary["rl"]["obs_norm"]["count"] == 8 * (1 + 4 * 64)  # all-reduced over both ranks' 4 envs


@pytest.mark.e2e
def test_the_bring_your_own_training_command_trains(tmp_path):
    argv = _bash_line("multigpu train --model examples.byo_train:regressor")
    proc = run_cli(*argv, "steps=20", "eval_every=10", "checkpoint_every=0", "--run-dir", str(tmp_path / "run"),
                   env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["unit"] == "samples"
    val = [r["val_loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0], val


def test_the_accelerate_line_launches_the_same_job_as_our_spelling(fake_gpus, capsys):
    """The README's ``multigpu launch --num-processes 2 --mixed-precision bf16 train.py`` (torch's launcher mocked)
    is ``--nproc-per-node 2`` with accelerate's precision variable set, and says its translation once."""
    from tests.cli.test_launch_aliases import _launched

    argv = _bash_line("multigpu launch --num-processes 2 --mixed-precision bf16")
    assert argv[0] == "launch" and argv[-1] == "train.py"
    theirs, env, said = _launched(argv[1:-1], fake_gpus, capsys)
    ours, _, _ = _launched(["--nproc-per-node", "2"], fake_gpus, capsys)
    assert theirs == ours and theirs[0] == 2
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and said.count("--mixed-precision is precision=bf16 here") == 1


@pytest.mark.e2e
def test_the_token_files_and_hugging_face_commands_run_as_written(tmp_path):
    """The README's nanoGPT token-file command, in a folder holding data/shakespeare/{train,val}.bin as nanoGPT's
    prepare.py writes them, and its Hugging Face command (skipped without transformers) on notes.txt; both on
    one rank for a few steps; the Hugging Face model shrunk in width and compiled eagerly (compiling GPT-2 on a
    CPU takes minutes), everything else as the README says, the safetensors export included."""
    import numpy as np

    data = tmp_path / "data" / "shakespeare"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 65, 30_000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 65, 3_000, dtype=np.uint16).tofile(data / "val.bin")
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    short = ["--nproc-per-node", "1", "steps=2", "batch_size=2", "eval_every=0", "log_every=1"]
    argv = _bash_line("multigpu train --data multigpu.train.data:token_files")
    proc = run_cli(*argv, *short, "--run-dir", str(tmp_path / "tokens"), env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "30,000 train tokens, 3,000 validation (uint16" in proc.stdout, proc.stdout[-2000:]
    assert json.loads((tmp_path / "tokens" / "summary.json").read_text())["final_step"] == 2

    pytest.importorskip("transformers", reason="transformers is not installed")
    (tmp_path / "notes.txt").write_text(README)
    argv = _bash_line("multigpu train --model multigpu.train.hf:causal_lm")
    proc = run_cli(*argv, *short, "compile=false", "block_size=32", "model.kwargs.n_embd=32", "model.kwargs.n_head=2",
                   "--run-dir", str(tmp_path / "hf"), env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "hf" / "summary.json").read_text())["final_step"] == 2
    exported = list((tmp_path / "hf").rglob("*.safetensors"))
    assert len(exported) == 1, exported
    from safetensors.torch import load_file

    weights = load_file(exported[0])
    assert weights["lm_head.weight"].shape[1] == 32  # tied with the token embedding: stored once
    assert {name.split(".")[2] for name in weights if name.startswith("transformer.h.")} == {"0", "1"}  # n_layer=2
