"""Demo models for ``multigpu infer``: conv nets with fixed filters, meaningful without any weights.

Each factory returns an ``nn.Module`` taking float images in [0, 1]::

    multigpu infer --model multigpu.infer.models:denoiser  --input noisy.png --output out/
    multigpu infer --model multigpu.infer.models:edges     --input photo.png --output out/   # 3 -> 1 channel
    multigpu infer --model multigpu.infer.models:upsample2x --input photo.png --output out/  # x2 the size

``noisy_demo_image(path)`` writes the demo input: matplotlib's sample photo
(Grace Hopper) with seeded Gaussian noise, or a generated test pattern when
matplotlib is not installed.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from multigpu.errors import ConfigError

__all__ = ["DEMO_SIZE", "denoiser", "edges", "load_model", "noisy_demo_image", "upsample2x"]

DEMO_SIZE = (600, 512)
"""Height and width of the demo photo (matplotlib's sample, or the pattern drawn without matplotlib)."""



def _gaussian_kernel(size: int, sigma: float) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32) - (size - 1) / 2
    k = torch.exp(-(x**2) / (2 * sigma**2))
    k = k / k.sum()
    return torch.outer(k, k)


def _fixed_conv(in_ch: int, out_ch: int, kernel: torch.Tensor, groups: int = 1) -> nn.Conv2d:
    size = kernel.shape[-1]
    conv = nn.Conv2d(in_ch, out_ch, size, padding=size // 2, padding_mode="replicate", groups=groups, bias=False)
    with torch.no_grad():
        conv.weight.copy_(kernel)
    conv.requires_grad_(False)
    return conv


def denoiser(channels: int = 3, sigma: float = 1.5) -> nn.Module:
    """Gaussian denoiser: a depthwise conv with a fixed Gaussian kernel (``sigma`` in pixels)."""
    size = 2 * math.ceil(3 * sigma) + 1
    kernel = _gaussian_kernel(size, sigma).expand(channels, 1, size, size)
    return nn.Sequential(_fixed_conv(channels, channels, kernel, groups=channels)).eval()


class _Edges(nn.Module):
    """Luma (1x1 conv), Sobel x/y (3x3 conv), gradient magnitude: edge strength in [0, ~1]."""

    def __init__(self, channels: int):
        super().__init__()
        luma = torch.tensor([0.299, 0.587, 0.114]) if channels == 3 else torch.full((channels,), 1.0 / channels)
        self.luma = _fixed_conv(channels, 1, luma.reshape(1, channels, 1, 1))
        sobel_x = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]]) / 4.0
        self.sobel = _fixed_conv(1, 2, torch.stack([sobel_x, sobel_x.T])[:, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.sobel(self.luma(x))
        return torch.sqrt(g[:, :1] ** 2 + g[:, 1:] ** 2)


def edges(channels: int = 3) -> nn.Module:
    """Sobel edge detector: ``channels`` in, one channel (edge strength) out."""
    return _Edges(channels).eval()


def upsample2x(channels: int = 3, amount: float = 0.5) -> nn.Module:
    """x2 super-resolution without weights: bilinear upsampling, then a fixed unsharp-mask conv."""
    identity = torch.zeros(3, 3)
    identity[1, 1] = 1.0
    sharpen = (1 + amount) * identity - amount * _gaussian_kernel(3, 0.8)
    return nn.Sequential(
        nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
        _fixed_conv(channels, channels, sharpen.expand(channels, 1, 3, 3), groups=channels),
    ).eval()


def noisy_demo_image(path: str | Path, noise: float = 0.08, seed: int = 0) -> Path:
    """Write the demo input to ``path`` (PNG) and return it: a sample photo plus seeded Gaussian noise."""
    from PIL import Image

    try:
        from matplotlib import cbook

        with cbook.get_sample_data("grace_hopper.jpg") as fh:
            clean = np.asarray(Image.open(fh).convert("RGB"), dtype=np.float32) / 255.0
    except ImportError:  # no matplotlib: a generated pattern of rings and bars
        y, x = np.mgrid[0:600, 0:512].astype(np.float32)
        rings = 0.5 + 0.5 * np.sin(np.hypot(x - 256, y - 300) / 9.0)
        clean = np.stack([rings, (x // 64 % 2).astype(np.float32), y / 600.0], axis=2)
    noisy = clean + np.random.default_rng(seed).normal(0.0, noise, clean.shape).astype(np.float32)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.clip(np.rint(np.clip(noisy, 0, 1) * 255), 0, 255).astype(np.uint8)).save(path)
    return path


def load_model(spec):
    """Build the model from its factory and arguments; one-line ConfigError on any failure."""
    model = spec.build("--model")
    if not callable(model):
        raise ConfigError(f"--model {spec.factory!r} returned {type(model).__name__}, not a model (nn.Module or "
                          "a callable)")
    return model
