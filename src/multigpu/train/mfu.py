"""Model FLOPs utilization: how much of the devices' peak the training achieves (pure; inside each rank).

    mfu = tokens_per_s * flops_per_token / (peak_flops(device, precision) * world_size)

FLOPs per token follow nanoGPT / PaLM: ``6 N`` (forward and backward over the N
parameters) plus ``12 L H T`` for attention (L layers, width H, context T),
taken from the model when it says (``model.flops_per_token()``), else from a
Hugging Face config (``n_layer``/``num_hidden_layers`` ...), else ``6 N``.

The peaks (:data:`PEAK_TFLOPS`) are NVIDIA's dense data-sheet figures, looked up
by the board's exact name (``torch.cuda.get_device_name()``): an H100 SXM,
PCIe and NVL share "H100" but not a peak (989, 756 and 835 TFLOP/s bf16). fp32
is the TF32 tensor-core peak only while TF32 is on
(``torch.backends.cuda.matmul.allow_tf32``, which the trainer sets from ``tf32``),
else the plain fp32 peak. A board not in the table has no MFU (None), never a
guessed one; pass ``peak_tflops`` for it (CPUs included: there is no table for them).
``benchmarks/gpu`` uses the same table.
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_TFLOPS", "flops_per_token", "peak_flops", "peak_tflops_for"]

_H100_SXM = {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}
_H100_NVL = {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}
_V100 = {"fp16": 125.0, "fp32": 15.7}  # no bf16, no TF32
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # torch.cuda.get_device_name() -> dense TFLOP/s: bf16/fp16 tensor cores, tf32 tensor cores, fp32 without
    "NVIDIA H100 80GB HBM3": _H100_SXM,  # SXM5
    "NVIDIA H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H200": _H100_SXM,  # SXM: H100's compute, more and faster memory
    "NVIDIA H200 NVL": _H100_NVL,
    "NVIDIA GH200 480GB": _H100_SXM,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "NVIDIA L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "Tesla V100-SXM2-16GB": _V100,
    "Tesla V100-SXM2-32GB": _V100,
    "Tesla V100-PCIE-16GB": _V100,
    "Tesla V100-PCIE-32GB": _V100,
}
"""Looked up by the exact board name; a name not here has no peak (its MFU is not measured)."""


def peak_tflops_for(board: str, precision: str, tf32: bool) -> float | None:
    """Dense TFLOP/s of the board named exactly ``board`` at ``precision`` ("bf16", "fp16", "fp32"); fp32 means
    TF32 tensor cores when ``tf32``. None for an unlisted board or a precision it lacks."""
    peaks = PEAK_TFLOPS.get(board.strip())
    if peaks is None:
        return None
    key = "tf32" if precision == "fp32" and tf32 and "tf32" in peaks else precision
    return peaks.get(key)


def peak_flops(device: torch.device, precision: str, override_tflops: float | None = None, *,
               tf32: bool | None = None) -> float | None:
    """The device's peak FLOP/s at ``precision``; None where unknown (CPUs, unlisted boards) and not overridden.

    ``tf32``: whether fp32 matmuls run on TF32 tensor cores (default: the setting in force,
    ``torch.backends.cuda.matmul.allow_tf32``)."""
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    if tf32 is None:
        tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    tflops = peak_tflops_for(torch.cuda.get_device_name(device), precision, tf32)
    return tflops * 1e12 if tflops else None


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
