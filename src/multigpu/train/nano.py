"""The built-in workload of ``multigpu train``: a character-level GPT on text every machine has (both sides).

:class:`NanoConfig` is a :class:`~multigpu.train.TrainConfig` plus what this demo
trains: the GPT's shape (``model``), the text (``data``) and the sample printed
at the end. The generic trainer and its config know nothing of these.

    multigpu train -f nano model.n_layer=6 steps=400     # the packaged preset, two overrides
"""

from __future__ import annotations

from dataclasses import dataclass, field

from multigpu.train.config import TrainConfig, _require

__all__ = ["DataConfig", "ModelConfig", "NanoConfig"]


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
            _require(getattr(self, key) >= 1, f"model.{key}={getattr(self, key)} must be >= 1")
        _require(self.n_embd % self.n_head == 0,
                 f"model.n_embd={self.n_embd} must be divisible by model.n_head={self.n_head}")
        _require(0.0 <= self.dropout < 1.0, f"model.dropout={self.dropout} must be in [0, 1)")


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
        _require(self.max_chars >= 0, f"data.max_chars={self.max_chars} must be >= 0")
        _require(0.0 < self.val_percent < 100.0, f"data.val_percent={self.val_percent} must be in (0, 100)")


@dataclass(frozen=True, kw_only=True, slots=True)
class NanoConfig(TrainConfig):
    """The trainer's knobs plus the nano GPT, its text and its closing sample."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample_chars: int = 300
    """Characters of text generated at the end."""
    sample_prompt: str = "def "
    """The text the sample continues."""

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)  # zero-argument super() does not work in a slots dataclass
        _require(self.sample_chars >= 0, f"sample_chars={self.sample_chars} must be >= 0")
