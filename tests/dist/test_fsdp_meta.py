"""strategy=fsdp holds 1/N from the first byte: the model is built on meta and each rank materializes only its shards.

Pins: the built-in GPT built on meta and materialized shard by shard (1, 2 and 3
ranks) has exactly the values of the same GPT built on the host with the same
seed; a Hugging Face model and a plain torch model (``reset_parameters``) get
the same values on every world size; no rank ever allocates a whole parameter
set (the meta model has no storage until ``fully_shard`` has cut it).
"""

from __future__ import annotations

import pytest
import torch

from multigpu.testing import run_on_ranks
from tests.dist._tiny import VOCAB, tiny_gpt, tiny_hf

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
    from multigpu.train.fsdp import shard_model
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


@pytest.fixture(scope="module")
def by_world_size() -> dict[int, dict]:
    return {n: run_on_ranks(_all_models, n, timeout_s=180)[0] for n in (1, 2, 3)}


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
