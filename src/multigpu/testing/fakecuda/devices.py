"""The faked ``torch.cuda`` facts: devices, streams and events, random state (in the test process; see
:mod:`multigpu.testing.fakecuda`)."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["FakeCuda", "device_of", "record_stream"]


def device_of(tensor: torch.Tensor) -> torch.device:
    """The device a tensor is on, also while the fake mode runs a kernel on its meta stand-in."""
    return getattr(tensor, "fake_device", None) or tensor.device


class _Stream:
    """``torch.cuda.Stream`` of a faked GPU: how much work was queued on it, how far the host knows it has run, and
    how far it waited for other streams."""

    def __init__(self, cuda: FakeCuda, index: int, name: str) -> None:
        self.cuda, self.device, self.name = cuda, torch.device("cuda", index), name
        self.queued = 0
        """Operations queued so far (a position on this stream)."""
        self.completed = 0
        """The position up to which the host has seen this stream's work finish (an event, a synchronize)."""
        self.waited: dict[_Stream, int] = {}
        """For each other stream, the position up to which this one waits for it (``wait_event``, ``wait_stream``)."""

    def __repr__(self) -> str:
        return f"<{self.name} stream of {self.device}>"

    def enqueue(self) -> int:
        self.queued += 1
        return self.queued

    def wait_event(self, event: _Event) -> None:
        if event.stream is not None:
            self.waited[event.stream] = max(self.waited.get(event.stream, 0), event.position)

    def wait_stream(self, stream: _Stream) -> None:
        self.waited[stream] = max(self.waited.get(stream, 0), stream.queued)

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event(self.cuda)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.completed = self.queued

    def query(self) -> bool:
        self.synchronize()  # the fake GPU is done with everything queued
        return True

    def is_capturing(self) -> bool:
        return False  # no CUDA graph is being captured


class _Event:
    """``torch.cuda.Event``: remembers the stream and the position it was recorded at (see :class:`_Stream`)."""

    def __init__(self, cuda: FakeCuda, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        self.cuda, self.enable_timing = cuda, enable_timing
        self.stream: _Stream | None = None
        self.position = 0

    @property
    def recorded(self) -> bool:
        return self.stream is not None

    def record(self, stream: _Stream | None = None) -> None:
        if stream is not None and not isinstance(stream, _Stream):
            raise TypeError(f"Event.record() needs a torch.cuda.Stream, got {type(stream).__name__}")
        self.stream = stream or self.cuda.current_stream()
        self.position = self.stream.queued
        self.cuda.events_recorded += 1

    def synchronize(self) -> None:
        if self.stream is None:
            raise RuntimeError("synchronize() on a CUDA event that was never recorded")
        self.stream.completed = max(self.stream.completed, self.position)
        self.cuda.events_synchronized += 1

    def query(self) -> bool:
        if self.stream is not None:
            self.stream.completed = max(self.stream.completed, self.position)
        return True

    def wait(self, stream: _Stream | None = None) -> None:
        (stream or self.cuda.current_stream()).wait_event(self)

    def elapsed_time(self, end: _Event) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        for event in (self, end):
            if event.stream is None or event.stream.completed < event.position:
                raise RuntimeError("CUDA error: device not ready (elapsed_time of an event that has not completed: "
                                   "synchronize() or query() it first)")
        return 0.0  # milliseconds; the fake GPU takes no time


@dataclasses.dataclass
class FakeCuda:
    """What :func:`fake_cuda` yields: the faked ``torch.cuda`` facts and what the code asked of them."""

    devices: int
    capability: tuple[int, int] = (9, 0)
    """Compute capability every faked GPU reports (an H100's by default; (7, 0) is a V100: no bf16)."""
    synchronized: int = 0
    set_device_calls: list[int] = dataclasses.field(default_factory=list)
    rng_states: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    events_recorded: int = 0
    events_synchronized: int = 0
    streams_made: list[_Stream] = dataclasses.field(default_factory=list)
    pinned: int = 0
    """Host tensors pinned (``pin_memory()``)."""

    def __post_init__(self) -> None:
        self._defaults = [_Stream(self, i, "default") for i in range(self.devices)]
        self._local = threading.local()  # the current device and streams are per thread, as CUDA's

    # ---- devices ----------------------------------------------------------------------------------------

    @property
    def current(self) -> int:
        """This thread's current device (a new thread starts on device 0, as with CUDA)."""
        return getattr(self._local, "device", 0)

    def device_count(self) -> int:
        return self.devices

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: Any) -> None:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if not 0 <= index < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index} of {self.devices} visible)")
        self.set_device_calls.append(index)
        self._local.device = index

    def get_device_properties(self, device: Any = None) -> Any:
        import types

        self._index(self.current if device is None else device)
        major, minor = self.capability
        return types.SimpleNamespace(name="fake CUDA device", major=major, minor=minor, total_memory=80 << 30,
                                     multi_processor_count=132)

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        props = self.get_device_properties(device)
        return props.major, props.minor

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return self.capability >= (8, 0)

    def synchronize(self, device: Any = None) -> None:
        index = self._index(self.current if device is None else device)
        for stream in [self._defaults[index], *(s for s in self.streams_made if s.device.index == index)]:
            stream.synchronize()
        self.synchronized += 1

    def memory_allocated(self, device: Any = None) -> int:
        self._index(self.current if device is None else device)
        return 0

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._index(self.current if device is None else device)
        return 80 << 30, 80 << 30

    # ---- streams and events -----------------------------------------------------------------------------

    def _streams(self) -> dict[int, _Stream]:
        if not hasattr(self._local, "streams"):
            self._local.streams = {}
        return self._local.streams

    def current_stream(self, device: Any = None) -> _Stream:
        index = self._index(self.current if device is None else device)
        return self._streams().get(index) or self._defaults[index]

    def default_stream(self, device: Any = None) -> _Stream:
        return self._defaults[self._index(self.current if device is None else device)]

    def set_stream(self, stream: _Stream) -> None:
        self._local.device = stream.device.index  # as torch.cuda.set_stream: the stream's device becomes current
        self._streams()[stream.device.index] = stream

    def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> _Stream:  # noqa: N802 - torch's name
        stream = _Stream(self, self._index(self.current if device is None else device), f"side #{len(self.streams_made)}")
        self.streams_made.append(stream)
        return stream

    @contextlib.contextmanager
    def stream(self, stream: _Stream | None) -> Iterator[None]:
        """``torch.cuda.stream(s)``: ``s`` current (and its device) inside the block, as before after it."""
        if stream is None:
            yield
            return
        device, before = self.current, self.current_stream(stream.device)
        self.set_stream(stream)
        try:
            yield
        finally:
            self._streams()[stream.device.index] = before
            self._local.device = device

    def Event(self, *args: Any, **kwargs: Any) -> _Event:  # noqa: N802 - torch.cuda.Event's name
        return _Event(self, *args, **kwargs)

    # ---- random state -----------------------------------------------------------------------------------

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        index = self._index(device)
        return self.rng_states.get(index, torch.full((16,), index, dtype=torch.uint8))

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        self.rng_states[self._index(device)] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [self.get_rng_state(i) for i in range(self.devices)]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for index, state in enumerate(states):
            self.set_rng_state(state, index)

    def manual_seed(self, seed: int) -> None:
        self.rng_states[self.current] = torch.full((16,), seed % 256, dtype=torch.uint8)

    def manual_seed_all(self, seed: int) -> None:
        for index in range(self.devices):
            self.rng_states[index] = torch.full((16,), seed % 256, dtype=torch.uint8)

    def _index(self, device: Any) -> int:
        if isinstance(device, int):
            index = device
        elif isinstance(device, _Stream):
            index = device.device.index
        else:
            device = torch.device(device)
            index = self.current if device.index is None else device.index
        if not 0 <= index < self.devices:
            raise IndexError(f"CUDA device {index} is not visible ({self.devices} visible)")
        return index


def record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """``Tensor.record_stream`` (its argument parser takes only torch's own streams, so it is replaced)."""
    if not isinstance(stream, _Stream):
        raise TypeError(f"record_stream() needs a torch.cuda.Stream, got {type(stream).__name__}")
    if device_of(tensor) != stream.device:
        raise RuntimeError(f"record_stream: a {device_of(tensor)} tensor cannot be recorded on {stream}")
