"""One collective call as multigpu runs it (inside each rank): timed into this rank's collective time, torch's
errors rewritten into ours, a heartbeat for the watchdog; and the barrier.

The call's rank, world size and timeout come as arguments, so that this module reads no state of the process
group: the collectives (:mod:`multigpu.runtime.collectives`, which read the group) and the group itself
(:mod:`multigpu.runtime.group`, whose ``shutdown()`` waits at a barrier before it destroys the group) both
stand above it.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from multigpu.errors import CollectiveError, CollectiveTimeoutError
from multigpu.runtime import watchdog
from multigpu.runtime.devicetime import DeviceSpans, is_async

__all__ = ["barrier", "collective_seconds", "comm_between", "comm_mark", "lost_peer", "timed"]

_COLLECTIVE_S = 0.0  # host time spent inside our collectives on this rank (read by the monitor)
_DEVICE_SPANS = DeviceSpans()  # CUDA collectives: their device time, from events (the host only queues them)


def collective_seconds() -> float:
    """Seconds this rank has spent in multigpu's collectives since it started.

    Host time for collectives that block the host (gloo, objects, barriers); for a tensor collective on CUDA,
    the device time between events recorded on the current stream before and after it (the stream waits for
    NCCL there): a span counts once its end event has completed, so read this after the work has run
    (``StepMeter`` reads each step's collectives by :func:`comm_between`, one step later).
    """
    return _COLLECTIVE_S + _DEVICE_SPANS.seconds()


def comm_mark() -> tuple[float, int]:
    """Where this rank's collective time stands now; :func:`comm_between` two marks gives the time between them."""
    return _COLLECTIVE_S, _DEVICE_SPANS.mark()


def comm_between(first: tuple[float, int], last: tuple[float, int]) -> float:
    """Seconds this rank spent in multigpu's collectives between two :func:`comm_mark` marks: host time, plus the
    device time of the CUDA collectives begun between them (waiting for their end events if they have not run:
    read it once the stream has passed them, as ``StepMeter`` does one step later)."""
    return last[0] - first[0] + _DEVICE_SPANS.seconds_between(first[1], last[1])


def _first_line(exc: BaseException) -> str:
    """torch's message without gloo's source location and sign-off."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    first = re.sub(r"\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first)
    return first.split(". This is typically caused")[0].rstrip(". ")


@contextlib.contextmanager
def timed(op: str, rank: int, world_size: int, timeout_s: float,
          device: torch.device | None = None) -> Iterator[None]:
    """Time the collective ``op`` of rank ``rank`` (of ``world_size``, under ``timeout_s``) and rewrite torch's
    errors into ours, naming rank and call.

    ``device``: the tensor's device; on CUDA the collective is timed on the device (see collective_seconds).
    """
    global _COLLECTIVE_S
    on_device = is_async(device)
    span = _DEVICE_SPANS.begin(device) if on_device else None
    start = time.perf_counter()
    try:
        yield
    except (RuntimeError, dist.DistBackendError) as exc:
        first = _first_line(exc)
        low = str(exc).lower()
        where = f"{op}() on rank {rank} of {world_size}"
        elapsed = time.perf_counter() - start
        timed_out = "timed out" in low or "timeout" in low or "failed to pass monitoredbarrier" in low
        if timed_out and elapsed < 0.9 * timeout_s:
            # gloo reports a peer that died mid-call as a failed barrier, long before the timeout
            raise CollectiveError(
                f"{where} failed after {elapsed:.1f}s, well before its {timeout_s:g}s timeout: {first}. "
                "That rank probably exited or crashed; see its log."
            ) from exc
        if timed_out:
            raise CollectiveTimeoutError(
                f"{where} timed out after {timeout_s:g}s: {first}. "
                "A rank probably skipped this call or is stuck before it (--timeout-s or mg.init(timeout_s=...) changes the limit)."
            ) from exc
        if lost_peer(low):
            raise CollectiveError(
                f"{where} lost a peer: {first}. Another rank probably exited or crashed; see its log."
            ) from exc
        raise
    finally:
        if span is not None:
            _DEVICE_SPANS.end(span, device)
        else:
            _COLLECTIVE_S += time.perf_counter() - start
        watchdog.heartbeat(f"{op}()")


def lost_peer(text: str) -> bool:
    """Whether an error's text is gloo's word that the rank at the other end of a connection is gone (also when
    torch's own calls raise it, e.g. DDP's all-reduce in a backward pass: "Connection reset by peer")."""
    low = text.lower()
    return "connection closed" in low or "connection reset" in low or "broken pipe" in low


def barrier(rank: int, world_size: int, timeout_s: float, *, monitor=None, monitored: bool = False) -> None:
    """Wait until every rank of the default group reaches this point.

    ``monitored`` (gloo jobs) or a ``monitor`` group (the gloo group beside NCCL): ``monitored_barrier``, so that
    when a rank does not arrive within the timeout, rank 0's error names the missing ranks. Else ``dist.barrier``.
    """
    with timed("barrier", rank, world_size, timeout_s):
        if monitored or monitor is not None:
            dist.monitored_barrier(group=monitor, timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        else:
            dist.barrier()
