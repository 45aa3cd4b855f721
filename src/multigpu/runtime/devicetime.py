"""Time on the device, not on the host (inside each rank).

On CUDA a call returns once its kernels are *queued*: the host clock around a
step or a collective measures queueing, and the GPU may still be minutes of
work behind. Two tools fix that without a device-wide sync in the hot loop:

* :func:`wait_for` records an event on the current stream and waits for it:
  the host clock read after it includes the queued work (the step meter ends
  every measured step this way);
* :class:`DeviceSpans` records a start and an end event around work on the
  current stream (a collective: the stream waits for NCCL's kernels there) and
  adds up their GPU-side elapsed time once the events have completed, without
  waiting for them.

On the CPU both are free: ``wait_for`` does nothing and the host clock is right.
"""

from __future__ import annotations

import torch

__all__ = ["DeviceSpans", "is_async", "wait_for"]


def is_async(device: torch.device | None) -> bool:
    """True where the host only queues work (CUDA): host time is not device time there."""
    return device is not None and device.type == "cuda"


def wait_for(device: torch.device | None) -> None:
    """Block until the work queued so far on ``device``'s current stream has run; nothing on the CPU."""
    if not is_async(device):
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    event.synchronize()  # this stream only: other streams (a data prefetcher) keep running


class DeviceSpans:
    """Seconds of device time in recorded spans, read without waiting for the device.

    ``begin(device)`` / ``end(token)`` bracket work queued on the current stream; ``seconds()`` is the total of
    the spans whose end event has completed (the rest are counted when a later call finds them done).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._done_s = 0.0

    def begin(self, device: torch.device) -> torch.cuda.Event:
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        return start

    def end(self, start: torch.cuda.Event, device: torch.device) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record(torch.cuda.current_stream(device))
        self._pending.append((start, stop))

    def seconds(self) -> float:
        """Device seconds of every completed span so far (a span still running is left for a later call)."""
        still = []
        for start, stop in self._pending:
            if stop.query():
                self._done_s += start.elapsed_time(stop) / 1000.0  # elapsed_time is in milliseconds
            else:
                still.append((start, stop))
        self._pending = still
        return self._done_s

    def pending(self) -> int:
        return len(self._pending)
