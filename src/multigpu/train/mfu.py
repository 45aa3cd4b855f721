"""Model FLOPs utilization: how much of the devices' peak the training achieves (pure; inside each rank).

    mfu = tokens_per_s * flops_per_token / (peak_flops(device, precision) * world_size)

FLOPs per token follow nanoGPT / PaLM: ``6 N`` (forward and backward over the N
parameters) plus ``12 L H T`` for attention (L layers, width H, context T),
taken from the model when it says (``model.flops_per_token()``), else from a
Hugging Face config (``n_layer``/``num_hidden_layers`` ...), else ``6 N``. The
peaks are the vendors' dense tensor-core figures; pass ``peak_tflops`` for any
other device (CPUs included: there is no table for them).
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_TFLOPS", "flops_per_token", "peak_flops"]

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # substring of torch.cuda.get_device_name() -> dense TFLOP/s by precision (fp32 = TF32 tensor cores)
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 60.0},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 62.5},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
}
"""Looked up by the first key found in the device name (H200 before H100: names share no prefix that matters)."""


def peak_flops(device: torch.device, precision: str, override_tflops: float | None = None) -> float | None:
    """The device's peak FLOP/s at ``precision``; None where unknown (CPUs, unlisted GPUs) and not overridden."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peaks in PEAK_TFLOPS.items():
        if key in name and peaks.get(precision):
            return peaks[precision] * 1e12
    return None


def flops_per_token(model: torch.nn.Module, block_size: int | None) -> float:
    """Training FLOPs per token of ``model`` (see the module docstring)."""
    own = getattr(model, "flops_per_token", None)
    if callable(own):
        return float(own())
    n = sum(p.numel() for p in model.parameters())
    cfg = getattr(model, "config", None)
    layers = next((getattr(cfg, k) for k in ("n_layer", "num_hidden_layers") if hasattr(cfg, k)), None)
    width = next((getattr(cfg, k) for k in ("n_embd", "hidden_size", "d_model") if hasattr(cfg, k)), None)
    attention = 12 * layers * width * block_size if layers and width and block_size else 0
    return float(6 * n + attention)
