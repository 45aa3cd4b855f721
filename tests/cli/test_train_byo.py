"""Bring your own model, data and loss to `multigpu train`: factories from a test file, nanoGPT token files,
a Hugging Face causal LM built from a config, safetensors export.

The factories below live in this test file, outside the package: `multigpu train --model
tests.cli.test_train_byo:make_model` imports them in every rank, as it would a user's module.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from tests.conftest import ROOT, assert_bad_input, run_cli

HERE = "tests.cli.test_train_byo"
ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
COMMON = ["eval_every=0", "log_every=5", "warmup_steps=1", "prefetch=0", "sample_chars=0"]


def make_model(width: int = 32) -> nn.Module:
    """A small regression MLP (a user's model factory with an argument)."""
    return nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, 1))


def make_data(n: int = 512):
    """(train, val) of y = sum(x) + noise: the same on every rank; the trainer's sampler splits it."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=gen)
    y = x.sum(dim=1, keepdim=True) + 0.01 * torch.randn(n, 1, generator=gen)
    return TensorDataset(x, y), TensorDataset(x[:64], y[:64])


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def _final(run_dir, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{step:08d}" / "state.pt", weights_only=True)["model"]


@pytest.mark.e2e
def test_a_users_model_data_and_loss_train_on_two_ranks_like_on_one(tmp_path):
    """Loss falls, and 2 ranks x 16 samples end where 1 rank x 32 samples does (same global batch)."""
    argv = ["--model", f"{HERE}:make_model", "model.kwargs.width=16", "--data", f"{HERE}:make_data", "--loss",
            f"{HERE}:mse", "unit=samples", "steps=10", "global_batch_size=32", "lr=0.05", "checkpoint_every=10",
            *COMMON]
    two = run_cli("train", *argv, "--nproc-per-node", "2", "--run-dir", str(tmp_path / "two"), env=ENV, timeout=240)
    assert two.returncode == 0, two.stderr[-3000:]
    one = run_cli("train", *argv, "--nproc-per-node", "1", "--run-dir", str(tmp_path / "one"), env=ENV, timeout=240)
    assert one.returncode == 0, one.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < 0.5 * losses[0], losses
    a, b = _final(tmp_path / "two", 10), _final(tmp_path / "one", 10)
    assert all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in a)
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["unit"] == "samples" and summary["items"] == 32 * (10 - summary["warmup_steps"])


@pytest.mark.e2e
def test_nanogpt_token_files_train_the_default_gpt(tmp_path):
    """A train.bin/val.bin pair as nanoGPT's prepare.py writes them (uint16), memory-mapped."""
    rng = np.random.default_rng(0)
    data = tmp_path / "tokens"
    data.mkdir()
    rng.integers(0, 97, 20_000, dtype=np.uint16).tofile(data / "train.bin")
    rng.integers(0, 97, 2_000, dtype=np.uint16).tofile(data / "val.bin")
    proc = run_cli("train", "--data", "multigpu.train.data:token_files", f"data.kwargs.path={data}",
                   "block_size=32", "model.kwargs.n_layer=1", "model.kwargs.n_embd=32", "model.kwargs.n_head=2",
                   "steps=4", "batch_size=4", "eval_every=2", "eval_batches=1", "checkpoint_every=0", "log_every=2",
                   "warmup_steps=1", "sample_chars=0", "--run-dir", str(tmp_path / "run"), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "20,000 train tokens, 2,000 validation (uint16, vocabulary 97)" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["unit"] == "tokens" and summary["items"] == 4 * 32 * (4 - summary["warmup_steps"])
    assert summary["val_loss"] is not None and summary["flops_per_token"] > 0


@pytest.mark.e2e
def test_a_hugging_face_causal_lm_from_a_config_trains_on_two_ranks_and_exports_safetensors(tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    pytest.importorskip("safetensors", reason="safetensors is not installed")
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    proc = run_cli("train", "--model", "multigpu.train.hf:causal_lm", "model.kwargs.config=gpt2",
                   "model.kwargs.n_layer=2", "model.kwargs.n_embd=32", "model.kwargs.n_head=2",
                   "--data", "multigpu.train.data:bytes_file", f"data.kwargs.path={text}", "block_size=32",
                   "steps=6", "batch_size=4", "lr=3e-3", "eval_every=6", "eval_batches=1", "checkpoint_every=0",
                   "log_every=3", "warmup_steps=1", "sample_chars=0", "peak_tflops=0.1", "--export", "safetensors",
                   "strategy=ddp", "--nproc-per-node", "2", "--run-dir", str(tmp_path / "run"), timeout=300,
                   env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MFU" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and 0 < summary["mfu"] < 1 and summary["val_loss"] < 5.6  # ln 256 = 5.55
    from safetensors.torch import load_model

    cfg = transformers.AutoConfig.for_model("gpt2", n_layer=2, n_embd=32, n_head=2, vocab_size=256, n_positions=1024,
                                            bos_token_id=None, eos_token_id=None)
    plain = transformers.AutoModelForCausalLM.from_config(cfg)
    missing, unexpected = load_model(plain, str(tmp_path / "run" / "model.safetensors"))
    assert not missing and not unexpected
    # the ddp case of tests/cli/test_train_export.py (this run serves both): the export is a folder that
    # from_pretrained reads, config.json beside the weights, the head tied to the embedding again
    run = tmp_path / "run"
    config = json.loads((run / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["vocab_size"] == 256
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(run), local_files_only=True)
    assert loaded.lm_head.weight.shape == (256, 32)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again
    from safetensors.torch import load_file

    saved = load_file(str(run / "model.safetensors"))
    for name, value in loaded.state_dict().items():
        if name in saved:
            assert torch.equal(value, saved[name]), f"{name}: from_pretrained loaded other values than were saved"


def test_a_saved_hugging_face_dataset_trains_a_causal_lm(tmp_path):
    """``multigpu.train.hf:saved_dataset``: a DatasetDict written with ``save_to_disk`` (token rows), dict batches
    into a tiny causal LM; tokens counted per real token (rows of 32)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    datasets = pytest.importorskip("datasets", reason="datasets is not installed")
    rng = np.random.default_rng(0)
    rows = lambda n: {"input_ids": rng.integers(0, 50, (n, 32)).tolist()}  # noqa: E731
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows(64)),
                          "validation": datasets.Dataset.from_dict(rows(8))}).save_to_disk(str(tmp_path / "ds"))
    proc = run_cli("train", "--model", "multigpu.train.hf:causal_lm", "model.kwargs.config=gpt2",
                   "model.kwargs.n_layer=1", "model.kwargs.n_embd=32", "model.kwargs.n_head=2",
                   "model.kwargs.vocab_size=50",
                   "--data", "multigpu.train.hf:saved_dataset", f"data.kwargs.path={tmp_path / 'ds'}", "block_size=32",
                   "steps=3", "batch_size=4", "eval_every=3", "eval_batches=1", "checkpoint_every=0", "log_every=1",
                   "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), timeout=300,
                   env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_DATASETS_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == 3 and summary["unit"] == "tokens"
    assert summary["items"] == summary["steps"] * 4 * 32  # real tokens: batch 4 x 32 per measured step
    assert 0 < summary["val_loss"] < 5.0  # ln 50 = 3.9 at random weights


def test_bad_factories_fail_in_the_launcher_with_one_line(tmp_path, capsys, fake_gpus):
    fake_gpus(0)
    cases = [
        (["--model", f"{HERE}:nothing_here"], "has no callable 'nothing_here'"),
        (["--model", f"{HERE}:make_model", "model.kwargs.depth=3"], "takes no argument 'depth' (from model.kwargs)"),
        (["--data", "multigpu.train.data:token_files", f"data.kwargs.path={tmp_path}"], "has no train.bin"),
        (["--loss", "torch.nn.functional:no_such_loss"], "has no callable 'no_such_loss'"),
        (["model.kwargs.n_embd=30", "model.kwargs.n_head=4"], "model.kwargs.n_embd=30 must be divisible"),
        # nanoGPT's GPT(config): the ranks could not call it; refused before anything starts
        (["--model", "tests.scripts.nanogpt_model:GPT"],
         "model.factory 'tests.scripts.nanogpt_model:GPT' cannot be called as it is: GPT() needs 'config' (no "
         "default); valid: give model.kwargs.config=..., or name a function that builds it"),
    ]
    for argv, message in cases:
        assert_bad_input(["train", *argv, "--run-dir", str(tmp_path / "run")], message, capsys, tmp_path / "run")


def test_the_train_custom_example_trains_as_python_runs_it(capsys, monkeypatch):
    """``python examples/train_custom.py`` (its second documented command: one process, the same code as on N
    ranks), in this process: the Trainer with the user's own model, data and loss learns the regression."""
    import runpy

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("sys.argv", ["examples/train_custom.py"])
    runpy.run_path(str(ROOT / "examples" / "train_custom.py"), run_name="__main__")
    out = capsys.readouterr().out
    final = [line for line in out.splitlines() if line.startswith("final val_loss ")]
    assert len(final) == 1 and final[0].endswith("samples/s on 1 rank(s)"), out
    assert float(final[0].split()[2].rstrip(";")) < 0.05, final  # from ~0.7 (the variance of y) at the start
