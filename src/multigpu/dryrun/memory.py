"""Device memory sizes for ``--device-memory``: ``80GB``, ``40GiB``, ``81559MiB`` or a GPU name (pure).

Decimal units are decimal (``80GB`` = 80 × 10⁹ bytes) and binary units binary (``80GiB`` = 80 × 2³⁰);
a GPU name means the memory ``nvidia-smi`` reports for that card (the table below), which is what
``torch.cuda.mem_get_info`` starts from, less the CUDA context's few hundred MiB.
"""

from __future__ import annotations

import re

from multigpu.errors import ConfigError

__all__ = ["GPUS", "parse_device_memory"]

_MIB = 2**20
GPUS: dict[str, int] = {
    "H200": 143771 * _MIB,
    "H100": 81559 * _MIB,  # SXM and PCIe 80GB
    "H100-NVL": 95830 * _MIB,
    "A100": 81920 * _MIB,  # the 80GB card
    "A100-80GB": 81920 * _MIB,
    "A100-40GB": 40960 * _MIB,
    "L40S": 46068 * _MIB,
    "L4": 23034 * _MIB,
    "A10G": 23028 * _MIB,
    "A10": 23028 * _MIB,
    "RTX4090": 24564 * _MIB,
    "V100": 32768 * _MIB,
    "V100-16GB": 16384 * _MIB,
    "T4": 15360 * _MIB,
}
"""Memory of known GPUs as ``nvidia-smi`` reports it (MiB × 2²⁰)."""

_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_device_memory(text: str) -> tuple[int, str]:
    """``(bytes, label)`` of a ``--device-memory`` value; one-line ConfigError naming what is valid."""
    key = text.strip().upper().replace(" ", "").replace("_", "-")
    if key in GPUS:
        return GPUS[key], f"{key} ({GPUS[key] // _MIB:,} MiB)"
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGT]I?B|B)", key)  # a unit always: a bare 80 is not 80 bytes
    if match and float(match.group(1)) > 0:
        return int(float(match.group(1)) * _UNITS[match.group(2)]), text.strip()
    raise ConfigError(f"--device-memory {text!r} is invalid; valid: a size such as 80GB, 40GiB or 24000MiB, "
                      f"or a GPU name: {', '.join(GPUS)}")
