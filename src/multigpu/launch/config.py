"""LaunchConfig: everything ``multigpu launch`` needs to start a job (runs in the launcher).

Note: torch has a class of the same name; we import it as ``TorchLaunchConfig``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from multigpu.errors import ConfigError

__all__ = ["LaunchConfig"]

_STREAMS = re.compile(r"^[0-3]$|^\d+:[0-3](,\d+:[0-3])*$")
"""torchrun's stream choice: one value, or local_rank:value pairs (torch's ``Std.from_str``)."""


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    nproc_per_node: int | Literal["auto"] = "auto"
    """Worker processes on this node; "auto" = one per selected GPU, else 1."""

    gpus: str | None = None
    """Which GPUs: "all", a count "N" (the first N), or indices "0,2" (of the visible ones)."""

    cpu: bool = False
    """Run every rank on the CPU (gloo) even where GPUs exist."""

    nnodes: int = 1
    """Number of machines taking part (with ``min_nodes``: the most that take part)."""

    min_nodes: int | None = None
    """``--nnodes MIN:MAX``'s MIN, as torchrun means it: the job runs on any number of nodes from ``min_nodes`` to
    ``nnodes``; a node lost or joining restarts the worker group at the new size (None: exactly ``nnodes``)."""

    node_rank: int | None = 0
    """Index of this machine, in [0, nnodes). Node 0 hosts the rendezvous store. None (several nodes, no
    ``--node-rank``, no scheduler: torchrun's elastic form): the node whose address is the endpoint's hosts the store
    and is node 0, the others take the next free index when they join (:mod:`multigpu.launch.nodes`)."""

    rdzv_endpoint: str = "localhost:0"
    """host:port of the rendezvous store; port 0 picks a free port (single node only)."""

    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Extra c10d rendezvous settings passed through to torch (e.g. is_host=false)."""

    run_id: str | None = None
    """Job id shared by all nodes; default: a fresh id on one node, "multigpu" on several."""

    max_restarts: int = 0
    """Restart the whole worker group up to this many times after a failure."""

    isolate_devices: bool = False
    """Each worker sees exactly one GPU through CUDA_VISIBLE_DEVICES, QD/TI_VISIBLE_DEVICE and EGL_DEVICE_ID."""

    allow_cpu_ranks: bool = False
    """Let ranks beyond the GPU count run on the CPU (hybrid job, gloo everywhere)."""

    share_gpus: bool = False
    """Let more ranks than GPUs share them round-robin, each pinned to its GPU; collectives over gloo."""

    log_dir: str | None = None
    """Where each worker's stdout/stderr and error file go (default: a temporary folder)."""

    timeout_s: float | None = None
    """Collective timeout inside the ranks, in seconds (the run context's ``timeout_s``)."""

    stall_timeout_s: float | None = None
    """End the job when a rank makes no progress (no collective, no meter step) for this long."""

    threads: int | None = None
    """CPU threads per rank (default: cores // nproc_per_node, unless OMP_NUM_THREADS is set)."""

    profile: bool = False
    """Record a torch.profiler trace per rank for a window of steps (see monitor.profile)."""

    profile_steps: tuple[int, int, int] = (1, 1, 3)
    """The profiler's window: steps to skip, to warm up, to record."""

    sample_interval_s: float = 1.0
    """Seconds between the device sampler's records in the run directory; 0: no sampler."""

    mixed_precision: str | None = None
    """accelerate's ``--mixed-precision`` (fp32, fp16, bf16): a script gets ``ACCELERATE_MIXED_PRECISION``."""

    monitor_interval_s: float = 0.1
    """How often the agent checks its workers, in seconds."""

    tee: str | None = None
    """torchrun's ``--tee``: which streams of each rank also go to log files while shown here (0 none, 1 stdout,
    2 stderr, 3 both; or per local rank, ``0:3,1:0``). Default: 3 with ``--log-dir`` or ``--rank-prefix``, else 0."""

    redirects: str | None = None
    """torchrun's ``--redirects``: which streams of each rank go to log files only (same values as ``tee``)."""

    local_ranks_filter: tuple[int, ...] | None = None
    """torchrun's ``--local-ranks-filter``: show only these local ranks' output here (the rest: log files only)."""

    rank_prefix: bool = False
    """Prefix every line a rank prints with ``[rank<R>]: `` (torchrun's form); needs the output teed."""

    @property
    def elastic(self) -> bool:
        """The job may run on fewer nodes than ``nnodes`` (``--nnodes MIN:MAX`` with MIN < MAX)."""
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def fewest_nodes(self) -> int:
        """The fewest nodes the job runs on: ``min_nodes``, else ``nnodes``."""
        return self.min_nodes if self.min_nodes is not None else self.nnodes

    def __post_init__(self) -> None:
        if self.nproc_per_node != "auto" and (not isinstance(self.nproc_per_node, int) or self.nproc_per_node < 1):
            raise ConfigError(
                f"--nproc-per-node {self.nproc_per_node} is invalid; valid: a whole number >= 1, or auto"
            )
        if self.nnodes < 1:
            raise ConfigError(f"--nnodes {self.nnodes} is invalid; valid: a whole number >= 1")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nnodes:
            raise ConfigError(f"--nnodes {self.min_nodes}:{self.nnodes} is invalid; valid: MIN:MAX with "
                              "1 <= MIN <= MAX, e.g. 1:4, or one number")
        if self.node_rank is None and self.nnodes == 1:
            object.__setattr__(self, "node_rank", 0)
        if self.node_rank is not None and not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(
                f"--node-rank {self.node_rank} is invalid with --nnodes {self.nnodes}; valid: 0 to {self.nnodes - 1}"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts {self.max_restarts} is invalid; valid: 0 or more")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError(f"--timeout-s {self.timeout_s} is invalid; valid: a number of seconds > 0")
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:
            raise ConfigError(f"--stall-timeout-s {self.stall_timeout_s} is invalid; valid: a number of seconds > 0")
        from multigpu.runtime.context import clamp_timeout

        for name in ("timeout_s", "stall_timeout_s"):  # longer: the clocks underneath overflow (the launcher says so)
            object.__setattr__(self, name, clamp_timeout(getattr(self, name)))
        if not self.sample_interval_s >= 0:
            raise ConfigError(f"--sample-interval-s {self.sample_interval_s} is invalid; valid: seconds >= 0 (0: off)")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"--threads {self.threads} is invalid; valid: 1 or more")
        for flag, value in (("--tee", self.tee), ("--redirects", self.redirects)):
            if value is not None and not _STREAMS.match(value):
                raise ConfigError(f"{flag} {value!r} is invalid; valid: 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
                                  "or per local rank such as 0:3,1:0")
        if self.local_ranks_filter is not None and (not self.local_ranks_filter
                                                    or any(r < 0 for r in self.local_ranks_filter)):
            raise ConfigError(f"--local-ranks-filter {self.local_ranks_filter} is invalid; valid: local ranks "
                              "such as 0 or 0,1")
        if self.cpu and self.gpus is not None:
            raise ConfigError(f"--cpu and --gpus {self.gpus} contradict each other; pass one of them")
        if self.cpu and self.isolate_devices:
            raise ConfigError("--cpu and --isolate-devices contradict each other; --isolate-devices pins GPUs")
