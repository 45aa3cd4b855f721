"""Time on the device, not on the host (inside each rank).

On CUDA a call returns once its kernels are *queued*: the host clock around a
step or a collective measures queueing, and the GPU may still be minutes of
work behind. Two tools fix that without a device-wide sync in the hot loop:

* :func:`wait_for` records an event on the current stream and waits for it:
  the host clock read after it includes the queued work;
* :func:`timed_event` records a timing event on the current stream: the step
  meter brackets each step with two and reads their GPU-side elapsed time one
  step later, when the GPU has run the step (no wait at the step's end);
* :class:`DeviceSpans` records a start and an end event around work on the
  current stream (a collective: the stream waits for NCCL's kernels there) and
  adds up their GPU-side elapsed time once the events have completed, without
  waiting for them.

On the CPU both are free: ``wait_for`` does nothing and the host clock is right.
"""

from __future__ import annotations

import torch

__all__ = ["DeviceSpans", "is_async", "timed_event", "wait_for"]


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


def timed_event(device: torch.device) -> torch.cuda.Event:
    """A timing event recorded now on ``device``'s current stream (CUDA only)."""
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


_KEEP_RESOLVED = 1 << 16  # spans' seconds kept for seconds_between() (a step meter reads them one step later)


class DeviceSpans:
    """Seconds of device time in recorded spans, read without waiting for the device.

    ``begin(device)`` / ``end(token)`` bracket work queued on the current stream; ``seconds()`` is the total of
    the spans whose end event has completed (the rest are counted when a later call finds them done).
    """

    def __init__(self) -> None:
        self._pending: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self._done_s = 0.0
        self._count = 0  # spans ended so far: a span's index, and a mark
        self._resolved: dict[int, float] = {}  # index -> seconds, of completed spans not yet read by range

    def begin(self, device: torch.device) -> torch.cuda.Event:
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        return start

    def end(self, start: torch.cuda.Event, device: torch.device) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record(torch.cuda.current_stream(device))
        self._pending.append((self._count, start, stop))
        self._count += 1
        if len(self._resolved) > _KEEP_RESOLVED:  # nobody reads them by range: keep the newest only
            self._resolved = {i: s for i, s in self._resolved.items() if i >= self._count - _KEEP_RESOLVED // 2}

    def mark(self) -> int:
        """The number of spans ended so far: spans ``[mark_a, mark_b)`` are those between two marks."""
        return self._count

    def _resolve(self, index: int, start: torch.cuda.Event, stop: torch.cuda.Event) -> None:
        seconds = start.elapsed_time(stop) / 1000.0  # elapsed_time is in milliseconds
        self._done_s += seconds
        self._resolved[index] = seconds

    def seconds(self) -> float:
        """Device seconds of every completed span so far (a span still running is left for a later call)."""
        still = []
        for index, start, stop in self._pending:
            if stop.query():
                self._resolve(index, start, stop)
            else:
                still.append((index, start, stop))
        self._pending = still
        return self._done_s

    def seconds_between(self, first: int, last: int) -> float:
        """Device seconds of the spans between two :meth:`mark` marks, waiting for those still running (read them
        once the stream has passed their end: the step meter reads a step's spans after the step's end event)."""
        still = []
        for index, start, stop in self._pending:
            if index < last:
                stop.synchronize()
                self._resolve(index, start, stop)
            else:
                still.append((index, start, stop))
        self._pending = still
        return sum(self._resolved.pop(i, 0.0) for i in range(first, last))

    def pending(self) -> int:
        return len(self._pending)
