"""``InferConfig``: what ``multigpu infer`` runs (validated in the launcher, read again by every rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from multigpu.errors import ConfigError
from multigpu.factory import Factory

__all__ = ["InferConfig", "MAX_ROI"]

MAX_ROI = 8192
"""Largest window side accepted (one window of 8192^2 float32 voxels per channel is already 256 MiB)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class InferConfig:
    model: Factory = field(default_factory=lambda: Factory(factory="multigpu.infer.models:denoiser"))
    """The model factory (``model.factory``: ``package.module:function``, ``model.kwargs``: its arguments);
    it returns an ``nn.Module`` or any callable taking a window batch."""
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of every model call (e.g. ``sigma: 0.05`` for a DRUNet taking ``(x, sigma)``)."""

    inputs: list[str] = field(default_factory=list)
    """Image files (PNG, JPEG, BMP, TIFF), ``.npy`` arrays or NIfTI volumes (``.nii``, ``.nii.gz``), 2-D or 3-D
    (3-D volumes get 3-D windows); sizes may differ. Empty: the demo photo with noise added."""

    output: str = ""
    """Folder for the outputs (one file per input, same stem). Empty: ``out/`` in the run directory."""

    roi: list[int] = field(default_factory=lambda: [256])
    """Window size in pixels: one value, or one per spatial dim."""

    overlap: list[float] = field(default_factory=lambda: [0.25])
    """Fraction of a window shared with its neighbour, in [0, 1): one value, or one per dim."""

    batch_size: int = 8
    """Windows per model call on each rank."""

    blend: Literal["constant", "gaussian", "crop"] = "gaussian"
    """How overlapping outputs are weighted: plain mean, Gaussian (window edges weigh less), or crop (each
    window keeps its inner part, up to the middle of each overlap: every pixel from exactly one window)."""

    sigma_scale: float = 0.125
    """Gaussian sigma as a fraction of the roi."""

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32, or bf16 / fp16 autocast around the model."""

    pad_mode: Literal["constant", "reflect", "replicate", "circular"] = "constant"
    """How an image smaller than the roi is padded."""

    max_decode_ratio: float = 100.0
    """The decompression-bomb guard: an input that would decode to more than this many times its file's size
    (and more than 256 MiB) is refused from its header. 0 turns the guard off (an image of one flat colour)."""


    def __post_init__(self) -> None:
        if ":" not in self.model.factory or not all(self.model.factory.partition(":")[::2]):
            raise ConfigError(f"infer.model.factory={self.model.factory!r} must look like package.module:factory, "
                              "e.g. multigpu.infer.models:denoiser")
        if not self.roi or len(self.roi) > 3 or any(not 1 <= r <= MAX_ROI for r in self.roi):
            raise ConfigError(f"infer.roi={self.roi} must be 1 to 3 sizes in [1, {MAX_ROI}], e.g. --roi 256")
        if not self.overlap or len(self.overlap) > 3 or any(not 0 <= o < 1 for o in self.overlap):
            raise ConfigError(f"infer.overlap={self.overlap} must be in [0, 1), e.g. --overlap 0.25")
        if self.batch_size < 1:
            raise ConfigError(f"infer.batch_size={self.batch_size} must be >= 1")
        if not self.max_decode_ratio >= 0:
            raise ConfigError(f"infer.max_decode_ratio={self.max_decode_ratio} must be >= 0 (0: no guard), e.g. 100")
        if not self.sigma_scale > 0:
            raise ConfigError(f"infer.sigma_scale={self.sigma_scale} must be > 0")
