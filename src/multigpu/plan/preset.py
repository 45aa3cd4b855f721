"""A train config (``-f nano`` or a YAML) as a :class:`~multigpu.plan.transformer.ModelSpec` (in the launcher).

The model is built on the ``meta`` device (shapes only, no memory), as the dry run builds it, to count its
parameters and read its sizes; the data factory runs once for its vocabulary.
"""

from __future__ import annotations

import contextlib
import sys

from multigpu.errors import ConfigError
from multigpu.plan.transformer import ModelSpec

__all__ = ["spec_from_config"]


def spec_from_config(config: str, overrides: list[str]) -> ModelSpec:
    import torch

    from multigpu.config import load_config
    from multigpu.presets import find_config
    from multigpu.train.job import TrainJobConfig

    cfg = load_config(TrainJobConfig, find_config(config), overrides)
    with contextlib.redirect_stdout(sys.stderr):  # a factory's own lines stay off stdout (--json reads it)
        out = cfg.data.build("data.factory", {"block_size": cfg.block_size, "vocab_size": None})
    train = out[0] if isinstance(out, tuple) else out
    vocab = getattr(train, "vocab_size", None)
    with torch.device("meta"):
        model = cfg.model.build("model.factory", {"block_size": cfg.block_size, "vocab_size": vocab})
    mc = getattr(model, "config", None) or getattr(model, "cfg", None)  # HF models: config; ours: cfg

    def first(*names):
        return next((getattr(mc, n) for n in names if getattr(mc, n, None) is not None), None)

    layers, hidden = first("n_layer", "num_hidden_layers"), first("n_embd", "hidden_size", "d_model")
    if not layers or not hidden:
        raise ConfigError(f"-f {config}: the model ({cfg.model.factory}) does not name its layers and width "
                          "(config.n_layer / n_embd or num_hidden_layers / hidden_size); valid: describe it with "
                          "key=value sizes instead (layers=, hidden=, seq=, batch=)")
    ffn = first("intermediate_size")
    precision = cfg.precision if cfg.precision != "fp32" else ("tf32" if getattr(cfg, "tf32", False) else "fp32")
    return ModelSpec(layers=int(layers), hidden=int(hidden), heads=first("n_head", "num_attention_heads"),
                     kv_heads=first("num_key_value_heads"), ffn=ffn, arch="llama" if ffn and first("rope_theta") else "gpt",
                     vocab=int(vocab or first("vocab_size") or 50304), seq=cfg.block_size, batch=cfg.batch_size,
                     grad_accum=cfg.grad_accum, params=float(sum(p.numel() for p in model.parameters())),
                     precision=precision, compile=cfg.compile,
                     ac="full" if cfg.activation_checkpointing else "none", strategy=cfg.strategy,
                     shard_size=getattr(cfg, "hsdp_shard_size", None), name=f"-f {config}")
