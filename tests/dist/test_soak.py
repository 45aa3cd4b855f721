"""Soak: thousands of small collectives in a row with flat memory and no leaked file handles.

The short form runs in CI; set MULTIGPU_SOAK_ITERS for a longer one (e.g. 50000).
"""

from __future__ import annotations

import os

import psutil
import pytest
import torch

import multigpu as mg
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

ITERS = int(os.environ.get("MULTIGPU_SOAK_ITERS", "2000"))


def _soak(iters: int) -> dict:
    proc = psutil.Process()
    warm = max(iters // 10, 50)
    samples = {}
    for i in range(iters):
        t = torch.full((16,), float(mg.rank() + i))
        mg.all_reduce(t, "sum", check_shapes=(i % 10 == 0))
        assert t[0].item() == 2 * i + 1  # ranks 0 and 1 contribute i and i + 1
        if i % 50 == 0:
            parts = mg.gather(torch.arange(3) + mg.rank(), dst=None)
            assert parts.tolist() == [0, 1, 2, 1, 2, 3]
            mg.barrier()
        if i == warm:
            samples["start"] = (proc.memory_info().rss, proc.num_fds(), len(proc.children(recursive=True)))
    samples["end"] = (proc.memory_info().rss, proc.num_fds(), len(proc.children(recursive=True)))
    return samples


def test_thousands_of_collectives_keep_memory_and_handles_flat():
    for rank, s in enumerate(run_on_ranks(_soak, 2, args=(ITERS,), timeout_s=240)):
        (rss0, fds0, kids0), (rss1, fds1, kids1) = s["start"], s["end"]
        assert rss1 - rss0 < 32 * 2**20, f"rank {rank} grew {(rss1 - rss0) / 2**20:.1f} MiB over {ITERS} iterations"
        assert fds1 <= fds0, f"rank {rank} leaked file handles: {fds0} -> {fds1}"
        assert kids1 <= kids0, f"rank {rank} leaked child processes"
