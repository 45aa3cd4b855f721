"""The default model of ``multigpu train``: nanoGPT's GPT, as a model factory (both sides).

    multigpu train -f nano model.kwargs.n_layer=6 steps=400    # the packaged preset, two overrides

:func:`gpt` builds :class:`~multigpu.train.model.GPT` from :class:`ModelConfig`
(checked in the launcher by ``gpt.check``); :class:`DataConfig` describes the
default text (:func:`multigpu.train.data.stdlib_text`). The generic trainer and
its config know nothing of either.
"""

from __future__ import annotations

from multigpu.factory import checked_by
from multigpu.train.data import VOCAB, DataConfig
from multigpu.train.model import GPT, ModelConfig

__all__ = ["DataConfig", "ModelConfig", "gpt"]


def _check_gpt(block_size: int = 128, vocab_size: int | None = None, n_layer: int = 4, n_head: int = 4,
               n_embd: int = 128, dropout: float = 0.0, bias: bool = False) -> None:
    ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, dropout=dropout, bias=bias)


@checked_by(_check_gpt)
def gpt(block_size: int = 128, vocab_size: int | None = None, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
        dropout: float = 0.0, bias: bool = False):
    """nanoGPT's decoder-only transformer; ``vocab_size`` defaults to the character vocabulary of the default text."""
    cfg = ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, dropout=dropout, bias=bias)
    return GPT(cfg, vocab_size or len(VOCAB))
