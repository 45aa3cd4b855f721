"""strategy=fsdp holds 1/N from the first byte: the model is built on meta and each rank materializes only its shards.

Pins: the built-in GPT built on meta and materialized shard by shard (1, 2 and 3
ranks) has exactly the values of the same GPT built on the host with the same
seed; a Hugging Face model and a plain torch model (``reset_parameters``) get
the same values on every world size; no rank ever allocates a whole parameter
set (the meta model has no storage until ``fully_shard`` has cut it).

Pretrained weights straight into shards: load -> 0 steps -> export gives back the input, bit for bit, on 1/2/3
ranks. A safetensors file (the built-in GPT with an odd vocabulary, so fsdp pads the tied embedding) and a
Hugging Face folder written by ``save_pretrained`` in several shards (``model.safetensors.index.json``) are read
by ``Trainer(config=...init_from=...)``: under fsdp on 2 and 3 ranks each rank reads only its own rows
(``get_slice``), and the model was built on meta, so no rank ever holds the whole model. The gathered export
equals the input file (the same header, the same data bytes) or, for the folder, every tensor bit for bit.

Both run in one job per world size (``by_world_size``): a job's start-up costs more than either check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from multigpu.testing import run_on_ranks
from tests.dist._tiny import tiny_gpt, tiny_hf

pytestmark = pytest.mark.dist


def _gpt():
    return tiny_gpt(block_size=16)


_hf = tiny_hf


def _plain():
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.LayerNorm(10), torch.nn.Linear(10, 5),
                               torch.nn.Linear(5, 5))


def _materialized(build) -> dict[str, torch.Tensor] | None:
    """``build`` on meta, sharded over the job, materialized; the whole state gathered on rank 0."""
    import multigpu as mg
    from multigpu.train import TrainConfig, make_optimizer
    from multigpu.train.strategies import shard_model
    from multigpu.train.job import full_state
    from multigpu.train.meta import build_on_meta, is_on_meta

    torch.manual_seed(5)
    model = build_on_meta(build, "test")
    assert is_on_meta(model) and all(p.is_meta for p in model.parameters())
    optimizer = make_optimizer(model, TrainConfig())
    if mg.world_size() == 1:
        from multigpu.train.meta import materialize

        materialize(model, torch.device("cpu"), seed=5, optimizer=optimizer)
        state = model.state_dict()
    else:
        shard_model(model, optimizer, device=torch.device("cpu"), seed=5)
        held = {n: p.to_local().numel() for n, p in model.named_parameters()}
        assert sum(held.values()) < sum(p.numel() for p in model.parameters())  # this rank holds its rows only
        state = full_state(model)
    assert not is_on_meta(model)
    params = {id(p) for p in model.parameters()}
    assert all(id(p) in params for g in optimizer.param_groups for p in g["params"])  # the optimizer has the new ones
    if not mg.is_main():
        return None
    buffers = {f"buffer:{k}": v.clone() for k, v in model.named_buffers()}  # buffers are whole on every rank
    return {**{k: v.detach().clone() for k, v in state.items()}, **buffers}


def _all_models() -> dict | None:
    return {"gpt": _materialized(_gpt), "hf": _materialized(_hf), "plain": _materialized(_plain)}


def _gpt8():
    return tiny_gpt(block_size=8)


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
    state = full_state(trainer.module) if trainer.strategy.sharded else trainer.module.state_dict()
    trainer.close()
    if mg.is_main():
        export_state(state, Path(out))
    return None


def _both(tmp: str) -> None:
    world = __import__("multigpu").world_size()
    _load_and_export(_gpt8, f"{tmp}/gpt.safetensors", f"{tmp}/gpt_out_{world}.safetensors")
    _load_and_export(_hf, f"{tmp}/hf", f"{tmp}/hf_out_{world}.safetensors")


def _header_and_data(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's parsed JSON header and its data bytes. Compared as parsed JSON: safetensors writes
    ``__metadata__`` from a Rust HashMap, so the order of its keys differs between processes."""
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + size]), raw[8 + size :]


def _pretrained_inputs(tmp: Path) -> None:
    """The inputs ``_both`` reads: the GPT's weights in one file, the Hugging Face model in several."""
    from multigpu.train.job import export_state

    torch.manual_seed(3)
    export_state(_gpt8().state_dict(), tmp / "gpt.safetensors")
    torch.manual_seed(4)
    _hf().save_pretrained(tmp / "hf", max_shard_size="20KB")  # several files and an index


def _every_check(tmp: str) -> dict | None:
    """One job: the meta builds (returned by rank 0), then the pretrained load-and-export (files under ``tmp``)."""
    models = _all_models()
    _both(tmp)
    return models


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("pretrained")
    _pretrained_inputs(tmp)
    return tmp


@pytest.fixture(scope="module")
def by_world_size(pretrained_dir) -> dict[int, dict]:
    return {n: run_on_ranks(_every_check, n, args=(str(pretrained_dir),), timeout_s=240)[0] for n in (1, 2, 3)}


def test_meta_built_gpt_equals_the_host_build_on_1_2_and_3_ranks(by_world_size):
    torch.manual_seed(5)
    host = _gpt().state_dict()
    for n, models in by_world_size.items():
        got = models["gpt"]
        assert set(got) == set(host)
        for key, value in host.items():
            assert torch.equal(value, got[key]), f"{n} ranks: {key} differs from the host build"


def test_hf_and_plain_models_get_the_same_values_on_every_world_size(by_world_size):
    for kind in ("hf", "plain"):
        one = by_world_size[1][kind]
        for n in (2, 3):
            for key, value in one.items():
                assert torch.equal(value, by_world_size[n][kind][key]), f"{kind}, {n} ranks: {key}"
        floats = [v for v in one.values() if v.is_floating_point()]
        assert all(torch.isfinite(v).all() for v in floats)
        weights = [v for k, v in one.items() if v.dim() == 2]
        assert all(v.std() > 0 for v in weights)  # drawn, not left as to_empty's garbage or zeros
    # the llama's rotary buffers (not in its state dict) were recomputed by its own init, not left empty
    torch.manual_seed(5)
    buffers = dict(_hf().named_buffers())
    assert any("inv_freq" in name for name in buffers)
    for n in (1, 2, 3):
        for name, value in buffers.items():
            assert torch.equal(value, by_world_size[n]["hf"][f"buffer:{name}"]), f"{n} ranks: {name}"


def test_weights_load_into_shards_and_export_bit_for_bit_on_1_2_and_3_ranks(pretrained_dir, by_world_size):
    from safetensors.torch import load_file

    tmp_path = pretrained_dir
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    hf_in: dict[str, torch.Tensor] = {}
    for file in sorted((tmp_path / "hf").glob("*.safetensors")):
        hf_in.update(load_file(file))
    original = _header_and_data(tmp_path / "gpt.safetensors")
    assert set(by_world_size) == {1, 2, 3}  # each job ran _both (see _every_check)
    for n in (1, 2, 3):
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

    export_state(_gpt8().state_dict(), tmp_path / "gpt.safetensors")
    with pytest.raises(ConfigError, match=r"no tensor named 'model.embed_tokens.weight' for this model"):
        check_weights(tmp_path / "gpt.safetensors", _hf())
    bigger = torch.nn.Linear(3, 5)
    export_state({"weight": torch.zeros(4, 3), "bias": torch.zeros(5)}, tmp_path / "lin.safetensors")
    with pytest.raises(ConfigError, match=r"'weight' has shape \[4, 3\] but this model's 'weight' has \[5, 3\]"):
        check_weights(tmp_path / "lin.safetensors", bigger)
    with pytest.raises(ConfigError, match="neither model.safetensors nor model.safetensors.index.json"):
        check_weights(tmp_path, bigger)
