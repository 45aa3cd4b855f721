"""A short all-reduce bandwidth test through the real launcher (runs in the launcher).

With two or more GPUs and NCCL it runs one rank per GPU on NCCL; otherwise two
CPU ranks on gloo. Figures follow nccl-tests (``all_reduce_perf``):

* *algbw* = bytes / seconds per all-reduce;
* *busbw* = algbw * 2 (n - 1) / n: the traffic each link carries in a ring
  all-reduce, comparable across world sizes and with hardware peak figures.

On GPUs it moves 256 MiB per all-reduce, 20 times, timed with CUDA events on
the ranks' streams (the host only queues NCCL's kernels); the doctor judges
the figure against the node's topology (NVLink, PCIe P2P, host memory).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["bus_bandwidth", "measure", "redirect_output"]


def bus_bandwidth(size_bytes: int, seconds: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (10^9 bytes/s) of one all-reduce of ``size_bytes`` taking ``seconds``."""
    algbw = size_bytes / seconds / 1e9
    return algbw, algbw * 2 * (world_size - 1) / world_size


GPU_SIZE_MIB = 256
"""On GPUs: large enough that NCCL reaches its bus bandwidth (16 MiB is latency-bound and passes a socket fallback)."""
GPU_ITERS = 20
CPU_SIZE_MIB = 16
CPU_ITERS = 5


def measure(*, gpus: int = 0, size_mib: int | None = None, iters: int | None = None,
            timeout_s: float = 60.0) -> dict[str, Any]:
    """Launch the test and return its figures. Worker output goes to a log file, not the terminal.

    ``size_mib``/``iters``: default 256 MiB x 20 on GPUs (timed with CUDA events), 16 MiB x 5 on CPU ranks."""
    from multigpu.launch import LaunchConfig, launch

    on_gpus = gpus >= 2
    size_mib = size_mib or (GPU_SIZE_MIB if on_gpus else CPU_SIZE_MIB)
    iters = iters or (GPU_ITERS if on_gpus else CPU_ITERS)
    cfg = LaunchConfig(nproc_per_node=gpus if on_gpus else 2, cpu=not on_gpus, timeout_s=timeout_s, threads=1)
    with tempfile.TemporaryDirectory(prefix="multigpu_doctor_") as tmp:
        out = Path(tmp) / "bandwidth.json"
        log = Path(tmp) / "output.log"
        with open(log, "w") as fh, redirect_output(fh.fileno()):
            try:
                launch(cfg, "multigpu.doctor._bandwidth_worker", [str(out), str(size_mib), str(iters)], module=True)
            except Exception:
                fh.flush()
                tail = log.read_text().strip().splitlines()[-3:]
                raise RuntimeError(" | ".join(tail) or "the bandwidth test failed") from None
        return json.loads(out.read_text())


class redirect_output:
    """Point this process's stdout and stderr (and so the workers') at ``fd`` for a while: ``with
    redirect_output(fh.fileno()): ...`` (a class, as ``contextlib.redirect_stdout``, which redirects Python's
    ``sys.stdout`` only, not the file descriptors the workers inherit)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.saved = (os.dup(1), os.dup(2))
        os.dup2(self.fd, 1)
        os.dup2(self.fd, 2)

    def __exit__(self, *exc) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(self.saved[0], 1)
        os.dup2(self.saved[1], 2)
        os.close(self.saved[0])
        os.close(self.saved[1])
