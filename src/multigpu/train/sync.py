"""Gradient sync backends: how DDP all-reduces gradients (inside each rank).

* ``auto``  - the process group's own: NCCL between GPUs, gloo on CPU ranks.
* ``nccl``  - NCCL; every rank must be on a GPU.
* ``gloo``  - gloo, through a separate gloo group when the default group is NCCL.
* ``cpu``   - a DDP communication hook that copies each gradient bucket to host
  memory, all-reduces it over a gloo group, and copies the average back: a job
  whose GPUs cannot talk to each other directly still trains correctly. It is
  synchronous (no overlap with the backward pass); it exists for correctness.

Every hook divides by ``world_size`` before the sum, as DDP's default hook does,
so ``gloo`` and ``cpu`` give bit-identical gradients. The gloo and cpu hooks
time their all-reduces: ``CommTimer.pop_seconds()`` is the time gradient
all-reduces were in flight during a step (the union over buckets; on gloo it
overlaps the backward compute). NCCL runs DDP's built-in hook, untimed: its
futures complete when the kernels are queued, not when they finish, so a
timed hook would report queueing time. There ``wrap_ddp`` returns
:class:`NotTimed`, whose ``pop_seconds()`` is None: the step meter then
reports communication as not measured, never as 0.
"""


import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from multigpu.errors import ConfigError, DeviceError
from multigpu.runtime.collectives import record_traffic
from multigpu.runtime.group import DistEnv

__all__ = ["CommTimer", "NotTimed", "cpu_allreduce_hook", "timed_allreduce_hook", "wrap_ddp"]


class CommTimer:
    """The group to all-reduce over, and the intervals gradient all-reduces were in flight."""

    def __init__(self, group, world_size: int):
        self.group = group
        self.world_size = world_size
        self._intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self._intervals.append((start, end))

    def pop_seconds(self) -> float:
        """Seconds covered by the recorded intervals (overlaps counted once); clears them."""
        with self._lock:
            spans, self._intervals = sorted(self._intervals), []
        total, cur_start, cur_end = 0.0, None, None
        for start, end in spans:
            if cur_end is None or start > cur_end:
                total += (cur_end - cur_start) if cur_end is not None else 0.0
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        return total + ((cur_end - cur_start) if cur_end is not None else 0.0)


class NotTimed:
    """DDP's own NCCL all-reduce: it communicates every step, and no host clock can time it."""

    def pop_seconds(self) -> None:
        return None


def timed_allreduce_hook(state: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (average, asynchronous), timed from launch to completion."""
    start = time.perf_counter()
    buf = bucket.buffer().div_(state.world_size)
    record_traffic("all_reduce", buf.numel() * buf.element_size())
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        state.add(start, time.perf_counter())
        return f.value()[0]

    return fut.then(done)


def cpu_allreduce_hook(state: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Stage the bucket through host memory and average it over a gloo group, then copy it back."""
    start = time.perf_counter()
    buf = bucket.buffer()
    record_traffic("all_reduce", buf.numel() * buf.element_size())
    host = buf.to("cpu", copy=True)  # a real copy even on CPU ranks, so this path is what runs on GPUs
    host.div_(state.world_size)
    dist.all_reduce(host, group=state.group)
    buf.copy_(host)
    state.add(start, time.perf_counter())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _gloo_group(env: DistEnv):
    """The default group when it is gloo, else a new gloo group beside NCCL (call on all ranks)."""
    return None if env.backend == "gloo" else dist.new_group(backend="gloo")


def wrap_ddp(
    module: torch.nn.Module,
    env: DistEnv,
    sync_backend: str,
    *,
    find_unused_parameters: bool = False,
    bucket_cap_mb: float = 25.0,
) -> tuple[DDP, CommTimer | NotTimed]:
    """Wrap ``module`` (already on ``env.device``) in DDP with the chosen sync backend. Call on all ranks.

    Returns DDP and what times its gradient all-reduces (``NotTimed`` on NCCL: see the module docstring)."""
    on_gpu = env.device.type == "cuda"
    if sync_backend == "nccl" and env.backend != "nccl":
        raise DeviceError(f"sync_backend=nccl needs every rank on its own GPU, but this job's collectives run on "
                          f"{env.backend} (a hybrid job, or ranks sharing a GPU); valid here: auto, gloo, cpu")
    ddp = DDP(
        module,
        device_ids=[env.device.index] if on_gpu else None,
        find_unused_parameters=find_unused_parameters,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,  # gradients live in the buckets: no copy in before, or out after, the all-reduce
        process_group=_gloo_group(env) if sync_backend == "gloo" else None,
    )
    if sync_backend == "cpu":
        timer = CommTimer(_gloo_group(env), env.world_size)
        ddp.register_comm_hook(timer, cpu_allreduce_hook)
    elif env.backend == "gloo" or sync_backend == "gloo":
        timer = CommTimer(ddp.process_group, env.world_size)
        ddp.register_comm_hook(timer, timed_allreduce_hook)
    else:
        timer = NotTimed()
    return ddp, timer


def check_sync_backend(sync_backend: str, device_type: str) -> None:
    """Launcher-side check: nccl needs GPU ranks."""
    if sync_backend == "nccl" and device_type != "cuda":
        raise ConfigError("--sync-backend nccl needs GPUs, but this job runs on CPU ranks; "
                          "valid here: auto, gloo, cpu")
