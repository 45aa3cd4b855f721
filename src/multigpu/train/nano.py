"""The default model of ``multigpu train``: nanoGPT's GPT, as a model factory (both sides).

    multigpu train -f nano model.kwargs.n_layer=6 steps=400    # the packaged preset, two overrides

:func:`gpt` builds :class:`~multigpu.train.model.GPT` from :class:`ModelConfig`
(checked in the launcher by ``gpt.check``); :class:`DataConfig` describes the
default text (:func:`multigpu.train.data.stdlib_text`). The generic trainer and
its config know nothing of either.
"""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.train.config import _require

__all__ = ["DataConfig", "ModelConfig", "gpt"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """The character-level GPT of ``multigpu train`` (nanoGPT's shape)."""

    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    block_size: int = 128
    """Context length in characters (one sample is this many characters)."""
    dropout: float = 0.0
    """Dropout probability (0 keeps runs independent of the split, bit for bit on resume either way)."""
    bias: bool = False
    """Biases in Linear and LayerNorm layers."""

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_head", "n_embd", "block_size"):
            _require(getattr(self, key) >= 1, f"model.kwargs.{key}={getattr(self, key)} must be >= 1")
        _require(self.n_embd % self.n_head == 0,
                 f"model.kwargs.n_embd={self.n_embd} must be divisible by model.kwargs.n_head={self.n_head}")
        _require(0.0 <= self.dropout < 1.0, f"model.kwargs.dropout={self.dropout} must be in [0, 1)")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Character-level text: by default the Python standard library's own source files."""

    path: str | None = None
    """A folder (searched recursively for ``pattern``) or one text file; None = the stdlib's folder."""
    pattern: str = "*.py"
    """File name pattern inside a folder."""
    max_chars: int = 2_000_000
    """Read files (in sorted order) until this many characters; 0 = no limit."""
    val_percent: float = 10.0
    """The last this-many percent of the text is held out for validation."""

    def __post_init__(self) -> None:
        _require(self.max_chars >= 0, f"data.kwargs.max_chars={self.max_chars} must be >= 0")
        _require(0.0 < self.val_percent < 100.0, f"data.kwargs.val_percent={self.val_percent} must be in (0, 100)")




def gpt(block_size: int = 128, vocab_size: int | None = None, n_layer: int = 4, n_head: int = 4, n_embd: int = 128,
        dropout: float = 0.0, bias: bool = False):
    """nanoGPT's decoder-only transformer; ``vocab_size`` defaults to the character vocabulary of the default text."""
    from multigpu.train.data import VOCAB
    from multigpu.train.model import GPT

    cfg = ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, dropout=dropout, bias=bias)
    return GPT(cfg, vocab_size or len(VOCAB))


def _check_gpt(block_size: int = 128, vocab_size: int | None = None, n_layer: int = 4, n_head: int = 4,
               n_embd: int = 128, dropout: float = 0.0, bias: bool = False) -> None:
    ModelConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, dropout=dropout, bias=bias)


gpt.check = _check_gpt
