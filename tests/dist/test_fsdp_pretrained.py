"""Pretrained weights straight into shards: load -> 0 steps -> export gives back the input, bit for bit, on 1/2/3 ranks.

A safetensors file (the built-in GPT with an odd vocabulary, so fsdp pads the tied
embedding) and a Hugging Face folder written by ``save_pretrained`` in several shards
(``model.safetensors.index.json``) are read by ``Trainer(config=...init_from=...)``:
under fsdp on 2 and 3 ranks each rank reads only its own rows (``get_slice``), and
the model was built on meta, so no rank ever holds the whole model. The gathered
export equals the input file (the same header, the same data bytes) or, for the folder, every tensor bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from multigpu.testing import run_on_ranks
from tests.dist._tiny import VOCAB, tiny_gpt, tiny_hf

pytestmark = pytest.mark.dist


def _gpt():
    return tiny_gpt(block_size=8)


_hf = tiny_hf


def _load_and_export(build, weights: str, out: str) -> int | None:
    """Meta build, setup with init_from (0 steps), export; returns the bytes rank 0 read from the file."""
    import multigpu as mg
    from multigpu.train import TrainConfig, Trainer, make_optimizer
    from multigpu.train.data import CharDataset
    from multigpu.train.job import export_state, full_state
    from multigpu.train.meta import build_on_meta

    cfg = TrainConfig(steps=1, batch_size=1, eval_every=0, log_every=0, prefetch=0, strategy="fsdp",
                      init_from=weights)
    model = build_on_meta(build, "test") if mg.world_size() > 1 else build()
    data = CharDataset(torch.zeros(64, dtype=torch.uint8), 8)
    trainer = Trainer(model, make_optimizer(model, cfg), data, config=cfg).setup()
    if mg.world_size() > 1:
        local = sum(p.to_local().numel() for p in trainer.module.parameters())
        assert local < sum(p.numel() for p in trainer.module.parameters())  # this rank holds its rows only
    state = full_state(trainer.module) if trainer.sharded else trainer.module.state_dict()
    trainer.close()
    if mg.is_main():
        export_state(state, Path(out))
    return None


def _both(tmp: str) -> None:
    world = __import__("multigpu").world_size()
    _load_and_export(_gpt, f"{tmp}/gpt.safetensors", f"{tmp}/gpt_out_{world}.safetensors")
    _load_and_export(_hf, f"{tmp}/hf", f"{tmp}/hf_out_{world}.safetensors")


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's parsed JSON header and its data bytes. Compared as parsed JSON: safetensors writes
    ``__metadata__`` from a Rust HashMap, so the order of its keys differs between processes."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def test_weights_load_into_shards_and_export_bit_for_bit_on_1_2_and_3_ranks(tmp_path):
    from safetensors.torch import load_file

    from multigpu.train.job import export_state

    torch.manual_seed(3)
    export_state(_gpt().state_dict(), tmp_path / "gpt.safetensors")
    torch.manual_seed(4)
    _hf().save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # several files and an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf_in: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        hf_in.update(load_file(file))
    original = _header_and_data(tmp_path / "gpt.safetensors")
    for n in (1, 2, 3):
        run_on_ranks(_both, n, args=(str(tmp_path),), timeout_s=240)
        header, data = _header_and_data(tmp_path / f"gpt_out_{n}.safetensors")
        assert header == original[0], f"{n} ranks: names, shapes, offsets or metadata differ"
        assert data == original[1], f"{n} ranks: the tensors' bytes differ"
        out = load_file(tmp_path / f"hf_out_{n}.safetensors")
        assert set(out) == set(hf_in), f"{n} ranks"
        for key, value in hf_in.items():
            assert torch.equal(out[key], value) and out[key].dtype == value.dtype, f"{n} ranks: {key}"


def test_another_models_weights_are_one_line(tmp_path):
    from multigpu.errors import ConfigError
    from multigpu.train.job import export_state
    from multigpu.train.pretrained import check_weights

    export_state(_gpt().state_dict(), tmp_path / "gpt.safetensors")
    with pytest.raises(ConfigError, match=r"no tensor named 'model.embed_tokens.weight' for this model"):
        check_weights(tmp_path / "gpt.safetensors", _hf())
    bigger = torch.nn.Linear(3, 5)
    export_state({"weight": torch.zeros(4, 3), "bias": torch.zeros(5)}, tmp_path / "lin.safetensors")
    with pytest.raises(ConfigError, match=r"'weight' has shape \[4, 3\] but this model's 'weight' has \[5, 3\]"):
        check_weights(tmp_path / "lin.safetensors", bigger)
    with pytest.raises(ConfigError, match="neither model.safetensors nor model.safetensors.index.json"):
        check_weights(tmp_path, bigger)
