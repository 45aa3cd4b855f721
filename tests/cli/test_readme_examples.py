"""The README's examples run as a user copies them, and so do the docs pages' blocks that need more than the
page runner gives (tests/docs/test_examples.py runs every page's blocks as written): blocks picked by content,
run with the settings that make them short, their outputs checked.

The README keeps the quick start; the detailed examples it used to carry live on the docs pages named below.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.conftest import ROOT, run_cli
from tests.docs.markdown import bash_line, blocks, chains, python_block, run_chain

README_PATH = ROOT / "README.md"
README = README_PATH.read_text()
DOCS = ROOT / "docs"
TRAIN_PAGE = DOCS / "workloads" / "train.md"
ENVS_PAGE = DOCS / "workloads" / "envs.md"
MONAI_PAGE = DOCS / "migration" / "monai.md"
ACCELERATE_PAGE = DOCS / "migration" / "accelerate.md"


def _user_package(tmp_path, module: str, page, block_containing: str) -> dict[str, str]:
    """``tmp_path/mypkg/<module>.py`` holding the page's block, as a user copies it; the env that imports it."""
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / f"{module}.py").write_text(python_block(page, block_containing))
    return {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src")])}


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= 300


def test_the_readme_runtime_api_block_runs_as_written(tmp_path):
    """Its Python block (no launcher: a job of one rank) prints rank 0's gathered squares."""
    runnable = [chain for chain in chains(README_PATH) if chain[0].lang == "python"]
    assert len(runnable) == 1
    block = runnable[0][0]
    block.markers.setdefault("expect", []).append("[0, 1, 4, 9, 16, 25, 36, 49, 64, 81]")
    run_chain(runnable[0], tmp_path, {"examples": ROOT / "examples"})


def _commands(path) -> list[str]:
    """Every command of the page's runnable bash blocks, comments dropped, continuations joined."""
    out = []
    for block in blocks(path):
        if block.lang == "bash" and block.runs:
            out += [" ".join(ln.split("#")[0].split()) for ln in block.code.replace("\\\n", " ").splitlines()
                    if ln.split("#")[0].strip()]
    return out


def test_every_readme_command_runs_on_a_docs_page_as_written():
    """The README's quick-start commands (its runnable bash blocks) are commands of runnable blocks of the docs
    pages, which tests/docs/test_examples.py runs: copied from the README, each works."""
    readme = _commands(README_PATH)
    assert any(c.startswith("multigpu train") for c in readme) and any(c.startswith("multigpu rl") for c in readme)
    on_pages = {c for page in DOCS.rglob("*.md") for c in _commands(page)}
    missing = [c for c in readme if c not in on_pages]
    assert not missing, f"README commands that no docs page runs: {missing}"


def test_the_monai_swap_block_gives_monais_output():
    monai = pytest.importorskip("monai.inferers", reason="monai is not installed")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.Tanh()).eval()
    scope = {"image": torch.rand(1, 1, 300, 280), "net": net}
    with torch.no_grad():
        exec(python_block(MONAI_PAGE, "from multigpu.infer import sliding_window_inference"), scope)  # noqa: S102
        theirs = monai.sliding_window_inference(scope["image"], (256, 256), 8, scope["net"], 0.25, "gaussian",
                                                padding_mode="replicate")  # the page's own image and net
    assert torch.allclose(scope["out"], theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
def test_the_env_factory_block_trains_through_multigpu_rl(tmp_path):
    """The envs page's ``mypkg/envs.py`` (gymnasium's own vector env) and its ``multigpu rl --env`` command, on its
    2 ranks, with its env.kwargs and --obs-norm; shortened to 4 updates (its target needs 2M env-steps)."""
    pytest.importorskip("gymnasium")
    env = _user_package(tmp_path, "envs", ENVS_PAGE, "def make_env(num_envs, seed, device, autoreset_mode")
    argv = bash_line(ENVS_PAGE, "multigpu rl --env mypkg.envs:make_env")
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
    argv = bash_line(TRAIN_PAGE, "multigpu train --model examples.byo_train:regressor")
    proc = run_cli(*argv, "steps=20", "eval_every=10", "checkpoint_every=0", "--run-dir", str(tmp_path / "run"),
                   env={"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["unit"] == "samples"
    val = [r["val_loss"] for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
           if "val_loss" in r]
    assert len(val) == 2 and val[1] < val[0], val


def test_the_accelerate_line_launches_the_same_job_as_our_spelling(fake_gpus, capsys):
    """The accelerate page's ``multigpu launch --num-processes 2 --mixed-precision bf16 train.py`` (torch's launcher mocked)
    is ``--nproc-per-node 2`` with accelerate's precision variable set, and says its translation once."""
    from tests.cli.test_launch_aliases import _launched

    argv = bash_line(ACCELERATE_PAGE, "multigpu launch --num-processes 2 --mixed-precision bf16")
    assert argv[0] == "launch" and argv[-1] == "train.py"
    theirs, env, said = _launched(argv[1:-1], fake_gpus, capsys)
    ours, _, _ = _launched(["--nproc-per-node", "2"], fake_gpus, capsys)
    assert theirs == ours and theirs[0] == 2
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16" and said.count("--mixed-precision is precision=bf16 here") == 1


@pytest.mark.e2e
def test_the_token_files_and_hugging_face_commands_run_as_written(tmp_path):
    """The training page's nanoGPT token-file command, in a folder holding data/shakespeare/{train,val}.bin as nanoGPT's
    prepare.py writes them, and its Hugging Face command (skipped without transformers) on notes.txt; both on
    one rank for a few steps; the Hugging Face model shrunk in width and compiled eagerly (compiling GPT-2 on a
    CPU takes minutes), everything else as the page says, the safetensors export included."""
    import numpy as np

    data = tmp_path / "data" / "shakespeare"
    data.mkdir(parents=True)
    rng = np.random.default_rng(0)
    rng.integers(0, 65, 30_000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 65, 3_000, dtype=np.uint16).tofile(data / "val.bin")
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    short = ["--nproc-per-node", "1", "steps=2", "batch_size=2", "eval_every=0", "log_every=1"]
    argv = bash_line(TRAIN_PAGE, "multigpu train --data multigpu.train.data:token_files")
    proc = run_cli(*argv, *short, "--run-dir", str(tmp_path / "tokens"), env=env, cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "30,000 train tokens, 3,000 validation (uint16" in proc.stdout, proc.stdout[-2000:]
    assert json.loads((tmp_path / "tokens" / "summary.json").read_text())["final_step"] == 2

    pytest.importorskip("transformers", reason="transformers is not installed")
    (tmp_path / "notes.txt").write_text(README)
    argv = bash_line(TRAIN_PAGE, "multigpu train --model multigpu.train.hf:causal_lm")
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
