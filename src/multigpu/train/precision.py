"""Precision: autocast, the fp16 grad scaler, the model dtype, and which of them a device supports.

``check_precision`` is a pure function of injected facts (the launcher runs it
before spawning, the ranks again for their own device). ``probe_support``
gathers the facts for one device type inside a rank; it runs CUDA work, so the
launcher never calls it for CUDA: ``planned_support`` decides from the compute
capability NVML reports (:class:`~multigpu.launch.devices.DevicePlan`), because
a CUDA tensor in the launcher would hold a CUDA context on GPU 0 for the whole
job (0.5-1 GiB, and a failure on GPUs in exclusive-process mode).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from multigpu.errors import ConfigError, DeviceError

__all__ = ["DTYPES", "PrecisionSupport", "autocast", "check_precision", "cpu_bf16_note", "planned_support",
           "probe_support"]

BF16_CAPABILITY = (8, 0)
"""CUDA compute capability from which bf16 runs natively (Ampere; what ``torch.cuda.is_bf16_supported`` asks)."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionSupport:
    """What a device type can do: bf16 arithmetic, and fp16/bf16 autocast."""

    device_type: str
    bf16: bool
    fp16_autocast: bool
    bf16_autocast: bool


def _autocast_works(device_type: str, dtype: torch.dtype) -> bool:
    try:
        with warnings.catch_warnings():  # "CUDA is not available ... Disabling autocast": then it fails below
            warnings.simplefilter("ignore")
            ctx = torch.autocast(device_type, dtype=dtype)
        with ctx:
            a = torch.ones(2, 2, device=device_type)
            (a @ a).sum().item()
        return True
    except (RuntimeError, AssertionError, ValueError):
        return False


def probe_support(device_type: str) -> PrecisionSupport:
    """Probe what ``device_type`` ("cpu", "cuda", "mps") supports in this process (a rank: for CUDA, its current GPU)."""
    if device_type == "cuda":  # the same rule as the launcher's, from this rank's own GPU
        return planned_support("cuda", torch.cuda.get_device_capability())
    # torch implements bf16 on CPU on every x86/ARM machine
    return PrecisionSupport(device_type, True, _autocast_works(device_type, torch.float16),
                            _autocast_works(device_type, torch.bfloat16))


def cpu_bf16_is_native() -> bool:
    """Does this CPU compute bf16 natively (AVX512-BF16 / AMX on x86, BF16 on Arm), as oneDNN reports it?

    Without it torch emulates bf16 matmuls in fp32 with conversions around them: ``--precision bf16`` then
    runs several times slower than fp32 (4x was seen) instead of faster.
    """
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return True  # unknown: say nothing


def cpu_bf16_note(precision: str, dtype: str, device_type: str) -> str | None:
    """One line for bf16 on a CPU that emulates it, else None."""
    if device_type != "cpu" or "bf16" not in (precision, dtype) or cpu_bf16_is_native():
        return None
    flag = "--precision bf16" if precision == "bf16" else "--dtype bf16"
    return (f"{flag} on this CPU: it has no native bf16 (no AVX512-BF16/AMX), so torch emulates it and it runs "
            "slower than fp32, not faster; fp32 is the faster choice here")


def planned_support(device_type: str, capability: tuple[int, int] | None) -> PrecisionSupport | None:
    """What the launcher knows of ``device_type`` without initializing CUDA; None: not known before the ranks start.

    CPU ranks are probed here (harmless); CUDA is decided from ``capability`` (NVML's compute capability of
    the job's lowest GPU): fp16 autocast everywhere, bf16 from 8.0.
    """
    if device_type != "cuda":
        return probe_support(device_type)
    if capability is None:
        return None
    bf16 = tuple(capability) >= BF16_CAPABILITY
    return PrecisionSupport("cuda", bf16=bf16, fp16_autocast=True, bf16_autocast=bf16)


def check_precision(precision: str, dtype: str, facts: PrecisionSupport) -> None:
    """Raise a one-line error when ``precision``/``dtype`` cannot run on the device described by ``facts``."""
    where = f"this job's {facts.device_type.upper()} ranks"
    if "bf16" in (precision, dtype) and not facts.bf16:
        raise DeviceError(f"bf16 is not supported on {where} (CUDA needs compute capability 8.0+); "
                          "valid here: --precision fp16 or fp32, --dtype fp32")
    if precision == "bf16" and not facts.bf16_autocast:
        raise DeviceError(f"--precision bf16: autocast to bf16 does not work on {where}; valid here: fp32")
    if precision == "fp16" and not facts.fp16_autocast:
        raise DeviceError(f"--precision fp16: autocast to fp16 is not supported on {where}; "
                          f"valid here: fp32{', bf16' if facts.bf16_autocast else ''}")
    if precision == "fp16" and dtype == "fp16":
        raise ConfigError("--precision fp16 with --dtype fp16: the grad scaler cannot unscale fp16 gradients; "
                          "use --dtype fp32 (mixed precision keeps fp32 weights), or --precision bf16")


def autocast(precision: str, device_type: str):
    """The autocast context of a forward pass (a no-op for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=DTYPES[precision])
