"""Training's pure parts: batch arithmetic, lr scaling and schedule, precision rules, data, checkpoints."""

from __future__ import annotations

import pytest
import torch

import multigpu as mg
from multigpu.checkpoint import CheckpointStore, PerRank, RngState, resolve
from multigpu.config import from_dict
from multigpu.errors import ConfigError, DeviceError
from multigpu.factory import Factory
from multigpu.train import TrainConfig
from multigpu.train.config import lr_scale_factor, per_rank_accum
from multigpu.train.data import VOCAB, CharDataset, decode, encode, find_files, load_text
from multigpu.train.nano import DataConfig
from multigpu.train.optim import lr_at
from multigpu.train.precision import PrecisionSupport, check_precision
from multigpu.train.strategies import CommTimer


def test_accumulation_global_or_per_rank_and_the_batch_split():
    assert [per_rank_accum(8, "global", w) for w in (1, 2, 4)] == [8, 4, 2]
    assert per_rank_accum(3, "per_rank", 4) == 3
    with pytest.raises(ConfigError, match="grad_accum=3 .* not divisible by world_size=2"):
        per_rank_accum(3, "global", 2)
    cfg = TrainConfig(global_batch_size=64, grad_accum=2)
    assert (cfg.batch_per_rank(4), cfg.effective_batch(4)) == (8, 64)  # 64 / (4 ranks × 2 micro-steps)
    with pytest.raises(ConfigError, match="global_batch_size=64 is not divisible by world_size × grad_accum = 3 × 2"):
        cfg.validate_for(3)
    assert TrainConfig(batch_size=5, grad_accum=3).effective_batch(2) == 30


def test_lr_scaling_and_schedule():
    assert lr_scale_factor("none", 256, 64) == 1.0
    assert lr_scale_factor("linear", 256, 64) == 4.0
    assert lr_scale_factor("sqrt", 256, 64) == 2.0
    cfg = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=9)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(8, cfg) == pytest.approx(0.9)
    assert lr_at(9, cfg) == pytest.approx(1.0) and lr_at(100, cfg) == pytest.approx(0.1)
    assert 0.1 < lr_at(50, cfg) < 1.0


def test_config_rejects_bad_values_with_the_key():
    with pytest.raises(ConfigError, match="unknown config key 'stepz'. Did you mean 'steps'"):
        from_dict(TrainConfig, {"stepz": 3})
    with pytest.raises(ConfigError, match="'dtype' got 'fp64'; valid choices: 'fp32', 'bf16', 'fp16'"):
        from_dict(TrainConfig, {"dtype": "fp64"})
    gpt = Factory(factory="multigpu.train.nano:gpt", kwargs={"n_embd": 30, "n_head": 4})
    with pytest.raises(ConfigError, match="model.kwargs.n_embd=30 must be divisible by model.kwargs.n_head=4"):
        gpt.check("model.factory", {"block_size": 16})
    with pytest.raises(ConfigError, match=r"'multigpu.train.nano:gpt' takes no argument 'n_layers' \(from "
                                          r"model.kwargs\); valid: block_size, vocab_size, n_layer"):
        Factory(factory="multigpu.train.nano:gpt", kwargs={"n_layers": 2}).check("model.factory")
    with pytest.raises(ConfigError, match="module 'nowhere' does not import"):
        Factory(factory="nowhere:net").check("model.factory")


def test_precision_rules_on_injected_device_facts():
    old_gpu = PrecisionSupport("cuda", bf16=False, fp16_autocast=True, bf16_autocast=False)
    with pytest.raises(DeviceError, match="bf16 is not supported on this job's CUDA ranks"):
        check_precision("bf16", "fp32", old_gpu)
    with pytest.raises(DeviceError, match="bf16 is not supported"):
        check_precision("fp32", "bf16", old_gpu)
    check_precision("fp16", "fp32", old_gpu)  # fine
    no_fp16 = PrecisionSupport("cpu", bf16=True, fp16_autocast=False, bf16_autocast=True)
    with pytest.raises(DeviceError, match="autocast to fp16 is not supported .* valid here: fp32, bf16"):
        check_precision("fp16", "fp32", no_fp16)
    with pytest.raises(ConfigError, match="cannot unscale fp16 gradients"):
        check_precision("fp16", "fp16", PrecisionSupport("cuda", True, True, True))


def test_comm_timer_counts_overlapping_intervals_once():
    timer = CommTimer(None, 2)
    for span in [(0.0, 1.0), (0.5, 1.5), (3.0, 4.0)]:
        timer.add(*span)
    assert timer.pop_seconds() == pytest.approx(2.5)
    assert timer.pop_seconds() == 0.0


def test_data_vocab_split_and_errors(tmp_path):
    assert decode(encode("def f(x):\n\treturn é")) == "def f(x):\n\treturn \u2047"
    assert len(VOCAB) == 98
    for i in range(3):
        (tmp_path / f"m{i}.py").write_text("x = 1\n" * 50)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "skip.py").write_text("no")
    root, files = find_files(DataConfig(path=str(tmp_path)))
    assert [f.name for f in files] == ["m0.py", "m1.py", "m2.py"]
    text = load_text(DataConfig(path=str(tmp_path), val_percent=10))
    assert (len(text.train), len(text.val)) == (810, 90)
    ds = CharDataset(text.train, 16)
    x, y = ds[2]
    assert x.shape == (16,) and torch.equal(x[1:], y[:-1]) and len(ds) == (810 - 1) // 16
    with pytest.raises(ConfigError, match="does not exist"):
        find_files(DataConfig(path=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match=r"has no \*\.txt files"):
        find_files(DataConfig(path=str(tmp_path), pattern="*.txt"))
    with pytest.raises(ConfigError, match="fewer than the 1000"):
        load_text(DataConfig(path=str(tmp_path)), min_chars=1000)


def test_the_launchers_data_check_stops_at_the_first_file_and_keeps_its_errors(tmp_path):
    """The check before spawning stops at the first matching file (walking the whole standard library cost seconds
    on every launch), and a missing folder or a folder without matching files is still refused there."""
    from multigpu.train.data import _check_stdlib_text

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "notes.txt").write_text("x")
    (tmp_path / "b").mkdir()
    for i in range(3):
        (tmp_path / "b" / f"m{i}.py").write_text("x = 1\n")
    root, files = find_files(DataConfig(path=str(tmp_path)), first_only=True)
    assert root == tmp_path and len(files) >= 1 and all(f.suffix == ".py" for f in files)
    assert len(find_files(DataConfig(path=str(tmp_path)))[1]) == 3
    _check_stdlib_text(path=str(tmp_path))
    _check_stdlib_text(path=str(tmp_path / "b" / "m0.py"))
    with pytest.raises(ConfigError, match="does not exist"):
        _check_stdlib_text(path=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"has no \*\.rs files"):
        _check_stdlib_text(path=str(tmp_path), pattern="*.rs")


def test_default_data_is_the_standard_library():
    root, files = find_files(DataConfig())
    assert len(files) > 50 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)


def test_checkpoints_keep_the_last_k_and_skip_damaged_files(tmp_path):
    mg.init(backend="cpu", threads=1)
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        store.save(step, {"trainer": {"step": step}, "model": {"w": torch.ones(2) * step}, "optimizer": {},
                          "rng": PerRank(RngState())})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]
    (tmp_path / "step_00000004").mkdir()
    (tmp_path / "step_00000004" / "state.pt").write_bytes(b"half a file")
    assert store.latest().name == "step_00000003"
    state = store.load(store.latest(),
                       {"trainer": None, "model": None, "rng": PerRank(None)})
    assert state["trainer"]["step"] == 3 and state["_manifest"]["world_size"] == 1
    assert torch.equal(state["model"]["w"], torch.full((2,), 3.0)) and "torch" in state["rng"]
    assert CheckpointStore(tmp_path / "empty").latest() is None
    with pytest.raises(ConfigError, match="no such file or folder"):
        resolve(str(tmp_path / "missing"), None)


def test_token_files_too_large_for_the_launchers_scan_are_checked_on_the_ranks(tmp_path, monkeypatch):
    """val.bin's ids are checked against train.bin's vocabulary on the ranks where the launcher did not scan them."""
    import numpy as np

    from multigpu.errors import ConfigError
    from multigpu.train import data

    np.array(list(range(50)) * 12, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.array([3, 70, 5] * 100, dtype=np.uint16).tofile(tmp_path / "val.bin")
    monkeypatch.setattr(data, "_SCAN_IN_LAUNCHER", 0)
    data.token_files.check(str(tmp_path), block_size=8)  # sizes only: too large to scan here
    with pytest.raises(ConfigError, match=r"val.bin holds token id 70 but the vocabulary has 50 ids"):
        data.token_files(str(tmp_path), block_size=8)
