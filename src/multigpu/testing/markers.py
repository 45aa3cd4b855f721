"""pytest markers for tests that need devices (used by multigpu's own tests and by users')."""

from __future__ import annotations

import pytest

__all__ = ["requires_backend", "requires_gpus"]


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def requires_gpus(n: int = 1):
    """Skip unless at least ``n`` CUDA devices are visible; also marks the test ``gpu``."""

    def wrap(fn):
        fn = pytest.mark.gpu(fn)
        return pytest.mark.skipif(_cuda_count() < n, reason=f"needs {n} CUDA GPU(s), found {_cuda_count()}")(fn)

    return wrap


def requires_backend(name: str):
    """Skip unless torch.distributed has the backend ``name`` ("nccl", "gloo", "mpi")."""
    import torch.distributed as dist

    available = {"nccl": dist.is_nccl_available(), "gloo": dist.is_gloo_available(), "mpi": dist.is_mpi_available()}
    return pytest.mark.skipif(not available.get(name, False), reason=f"torch.distributed has no {name} backend here")
