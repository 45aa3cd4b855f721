"""Which device this rank computes on, and which process-group backend follows (inside each rank).

Pure functions of injected facts (CUDA device count, MPS availability, the
launcher's hints), so every rule is tested without GPUs.

Rules, for ``backend="auto"``: CUDA if any device is visible, then MPS, then CPU.
A rank uses ``cuda:local_rank``; a process that sees exactly one GPU uses
``cuda:0`` whatever its ``local_rank`` (``--isolate-devices``, SLURM's ``srun
--gpus-per-task=1``: every task sees only its own GPU while ``SLURM_LOCALID``
runs 0..7). A rank whose ``local_rank`` has no GPU among several runs on the
CPU in the launcher's hybrid mode (``--allow-cpu-ranks``), on GPU
``local_rank % count`` where ranks were asked to share GPUs (the run context's
process-group backend is gloo), and is otherwise an error naming both numbers. The process group is NCCL when every rank is on
CUDA, gloo otherwise (a hybrid job uses gloo on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from multigpu.errors import ConfigError, DeviceError

if TYPE_CHECKING:
    from multigpu.runtime.context import RunContext

__all__ = ["DeviceFacts", "choose_backend", "select_device", "BACKENDS"]

Backend = Literal["auto", "cuda", "mps", "cpu"]
BACKENDS = ("auto", "cuda", "mps", "cpu")


@dataclass(frozen=True)
class DeviceFacts:
    """What this process can see, gathered once (``DeviceFacts.probe()``) or faked in tests."""

    cuda_count: int = 0
    mps_available: bool = False
    isolated: bool = False
    """The launcher pinned this worker to one GPU (``--isolate-devices``)."""
    allow_cpu_ranks: bool = False
    """The launcher allowed ranks without a GPU to run on the CPU (hybrid mode)."""
    hybrid: bool = False
    """Some rank of this job runs on the CPU, so every rank must use gloo."""
    share_gpus: bool = False
    """Ranks were asked to share GPUs (collectives over gloo): a rank beyond the GPU count takes GPU
    ``local_rank % cuda_count`` instead of failing."""

    @classmethod
    def probe(cls, ctx: RunContext | None = None) -> DeviceFacts:
        """What torch sees here, plus the launcher's decisions from the run context (``ctx``: a RunContext)."""
        if ctx is None:
            from multigpu.runtime import context

            ctx = context.current()
        mps = getattr(torch.backends, "mps", None)
        return cls(
            cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
            mps_available=bool(mps and mps.is_available()),
            isolated=ctx.isolated,
            allow_cpu_ranks=ctx.allow_cpu_ranks,
            hybrid=ctx.hybrid,
            share_gpus=ctx.pg_backend == "gloo",
        )


def _cuda_device(local_rank: int, facts: DeviceFacts, required: bool) -> torch.device | None:
    if facts.cuda_count == 0:
        if required and not facts.allow_cpu_ranks:  # a hybrid job's CPU ranks are shown no GPU at all
            raise DeviceError(
                "backend='cuda' but this process sees no CUDA device; valid here: 'auto' or 'cpu'. "
                "Run `multigpu info` to see what torch finds."
            )
        return None
    if facts.isolated:
        return torch.device("cuda", 0)
    if local_rank < facts.cuda_count:
        return torch.device("cuda", local_rank)
    if facts.allow_cpu_ranks:
        return None
    if facts.cuda_count == 1:  # this process was given one GPU (srun --gpus-per-task=1): it is this rank's
        return torch.device("cuda", 0)
    if facts.share_gpus:
        return torch.device("cuda", local_rank % facts.cuda_count)
    raise DeviceError(
        f"local_rank {local_rank} has no GPU: this process sees {facts.cuda_count} CUDA device(s). Launch at most "
        f"{facts.cuda_count} process(es) per node, give each process one GPU (--isolate-devices, srun --gpus-per-task=1), "
        "or pass --allow-cpu-ranks to run the extra ranks on CPU."
    )


def select_device(backend: str, local_rank: int, facts: DeviceFacts) -> torch.device:
    """The device for ``local_rank`` under the requested ``backend`` ("auto", "cuda", "mps", "cpu")."""
    if backend not in BACKENDS:
        raise ConfigError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "cpu":
        return torch.device("cpu")
    if backend == "mps":
        if not facts.mps_available:
            raise DeviceError("backend='mps' but MPS is not available here; valid here: 'auto' or 'cpu'")
        return torch.device("mps")
    cuda = _cuda_device(local_rank, facts, required=backend == "cuda")
    if cuda is not None:
        return cuda
    if backend == "auto" and facts.cuda_count == 0 and facts.mps_available:
        return torch.device("mps")
    return torch.device("cpu")


def choose_backend(device: torch.device, world_size: int, facts: DeviceFacts, override: str | None = None) -> str:
    """The process-group backend: "none" alone, NCCL when every rank is on CUDA, gloo otherwise."""
    if world_size == 1:
        return "none"
    if override:
        if override not in ("nccl", "gloo"):
            raise ConfigError(f"process-group backend {override!r} is not one of nccl, gloo")
        return override
    if device.type == "cuda" and not facts.hybrid:
        return "nccl"
    return "gloo"
