"""Fake CUDA on a CPU-only machine: prove device placement without a GPU.

Runs inside the test process (no ranks, no launcher). Two pieces of torch do the work:

* ``FakeTensorMode`` makes ``device="cuda"`` tensors that hold no data and raise on
  mixed devices exactly as CUDA does (``index_add`` with a CPU index into CUDA data:
  "expected to be in the same device"; a CPU weight times a CUDA input: "Expected all
  tensors to be on the same device").
* the ``fake`` process-group backend (``FakeStore``) runs every collective at any world
  size in one process, so the code between collectives runs as rank ``r`` of ``N``
  (:func:`fake_group`; :func:`fake_init` lets ``init_process_group`` itself run, with the
  backend string and ``device_id`` an NCCL job passes).

What the fake answers as a GPU would, so that a test fails where a GPU would fail:

* **Moves.** ``Tensor.to("cuda")``, ``.cuda()``, ``Module.to("cuda")`` and copies between devices
  call into torch's C++ device guard, which a CPU build lacks. :class:`_CudaMoves` (a
  ``TorchFunctionMode``) answers them with a fake tensor on the target device. ``Module.to``
  keeps every Parameter object (its data is swapped in place, as a real move sets ``.data``),
  so an optimizer built before the move and tied weights (an embedding shared with the
  output head) stay as they are. Indexing CUDA data with a CPU index tensor is legal on
  CUDA (the index is moved) and emulated the same way.
* **Pinned memory.** ``pin_memory()`` of a tensor that is not on the CPU raises as torch does
  ("cannot pin ... only dense CPU tensors can be pinned"); a pinned CPU tensor says
  ``is_pinned()``. ``torch.accelerator`` answers as the faked host, so a ``DataLoader`` with
  ``pin_memory=True`` pins as it does on a GPU machine.
* **Streams and events.** Each device has a current stream per thread (a new thread starts on
  device 0 and its default stream, as with CUDA); ``torch.cuda.Stream``, ``torch.cuda.stream(s)``,
  ``wait_event``, ``wait_stream``, ``record_stream`` work. Every op on CUDA data is queued on
  the current stream of its device, and an event remembers the stream and the point it was
  recorded at. Two mistakes then raise as wrong results would follow on a GPU: the host reading
  the destination of a non-blocking copy from the GPU before an event recorded after the copy
  *on the copy's stream* (or the stream, or the device) was waited for; and CUDA data made on
  one stream used on another that has not waited for it (``wait_event``/``wait_stream``).
  ``elapsed_time`` needs both events made with ``enable_timing=True`` and completed.
* **The CUDA runtime is never called.** ``torch.cuda`` and ``torch.accelerator`` answer from
  :class:`FakeCuda`, and ``torch.cuda._lazy_init`` raises naming the call: the tier behaves
  the same on a CPU build and on a CUDA build of torch without a driver (a cluster's login
  node), where a real call would fail with "CUDA driver version is insufficient".
* **Backward on fake CUDA tensors cannot run** (the autograd engine asks the missing CUDA guard
  for a stream and the process aborts). Every call under :func:`fake_cuda` runs without a
  graph, and ``backward`` raises instead of aborting. A training step's backward is proved on
  the ``meta`` device instead, where the real autograd engine runs, DDP's hooks fire and a
  gradient on another device is refused as on a GPU (tests/fakecuda/test_train_cuda.py).
* ``.item()``, ``.tolist()`` and ``bool(tensor)`` need values: fake mode raises. On a real
  GPU these are host syncs, which belong outside the hot loop anyway.

Example::

    from multigpu.testing.fakecuda import fake_cuda, fake_group

    with fake_group(rank=3, world_size=64), fake_cuda(devices=8) as cuda:
        x = torch.zeros(5, device="cuda")
        torch.distributed.all_reduce(x)          # runs, as rank 3 of 64
        assert cuda.device_count() == 8           # torch.cuda.* answers as an 8-GPU host
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

__all__ = ["CudaInitialized", "FakeCuda", "StreamOrderError", "fake_cuda", "fake_group", "fake_init",
           "forbid_cuda_init", "is_fake"]


def _device(value: Any) -> torch.device:
    device = torch.device("cuda", value) if isinstance(value, int) else (
        value if isinstance(value, torch.device) else torch.device(value))
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def is_fake(tensor: Any) -> bool:
    """True for a tensor made under :func:`fake_cuda` (no data behind it)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class StreamOrderError(RuntimeError):
    """Data read before the stream that writes it was waited for: on a GPU, a silently wrong result."""


def _tensors_in(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _touches_gpu(args: tuple, kwargs: dict) -> bool:
    """Whether a call involves fake data or names a GPU (else it is host work, run on real tensors)."""
    def gpu(value: Any) -> bool:
        if isinstance(value, torch.Tensor):
            return is_fake(value)
        if isinstance(value, torch.device):
            return value.type == "cuda"
        if isinstance(value, str):
            return value.split(":")[0] == "cuda"
        if isinstance(value, (list, tuple)):
            return any(gpu(v) for v in value)
        return False

    return any(gpu(v) for v in (*args, *kwargs.values()))


def _where(tensor: torch.Tensor) -> torch.device:
    """The device a tensor is on, also while the fake mode runs a kernel on its meta stand-in."""
    return getattr(tensor, "fake_device", None) or tensor.device


# metadata and bookkeeping calls: they read no data, so they wait for nothing
_NO_READ = {"__get__", "__set__", "size", "dim", "numel", "stride", "element_size", "is_pinned", "record_stream",
            "is_contiguous", "data_ptr", "nelement", "__len__", "is_floating_point", "__hash__", "__repr__",
            "__format__", "untyped_storage", "storage_offset", "requires_grad_", "detach", "__reduce_ex__"}


class _CudaMoves(torch.overrides.TorchFunctionMode):
    """Answer the device moves a CPU build cannot dispatch with fake tensors on the target device, and keep the
    streams' order (see the module docstring): which stream wrote each CUDA result, and which host buffers a
    non-blocking copy from a GPU is still writing."""

    def __init__(self, mode, cuda: FakeCuda) -> None:
        super().__init__()
        self.mode, self.cuda = mode, cuda
        from torch.utils.weak import WeakIdKeyDictionary

        self.written: WeakIdKeyDictionary = WeakIdKeyDictionary()
        """tensor -> (stream, position): CUDA data, and host buffers of non-blocking copies from a GPU."""
        self.pinned: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._lock = threading.RLock()

    def _fake(self, like: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        meta = torch.empty_strided(like.shape, like.stride(), dtype=dtype or like.dtype, device="meta")
        return FakeTensor(self.mode, meta, device)

    def _target(self, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        device, dtype = kwargs.get("device"), kwargs.get("dtype")
        for arg in args[1:]:
            if isinstance(arg, torch.Tensor):
                device, dtype = arg.device, arg.dtype
            elif isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, bool):
                continue  # non_blocking
            elif isinstance(arg, (str, torch.device, int)):
                device = arg if not isinstance(arg, int) else torch.device("cuda", arg)
        return device, dtype

    def _to(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        tensor = args[0]
        device, dtype = self._target(args, kwargs)
        if device is None:
            return None
        target = _device(device)
        if "cuda" not in (target.type, tensor.device.type):
            return None
        if target == tensor.device:  # torch's binding would start CUDA for a device named without its index
            if kwargs.get("copy"):
                return tensor.clone() if dtype in (None, tensor.dtype) else tensor.to(dtype=dtype, copy=True)
            return tensor if dtype in (None, tensor.dtype) else tensor.to(dtype=dtype)
        return self._fake(tensor, target, dtype)

    def _getitem(self, tensor: torch.Tensor, index: Any) -> torch.Tensor:
        """``tensor[index]`` for CUDA data: the shape from the same indexing on meta tensors.

        torch's C++ indexing enters a CUDA device guard, which a CPU build lacks, so the result is
        computed on meta tensors and given the data's device. A CPU index tensor is legal on CUDA
        (torch moves it); an index on another GPU, or a boolean mask (its result's shape depends on
        the values, and reading it is a host sync on a real GPU too), raises.
        """
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        def meta(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device.type == "cuda" and value.device != tensor.device:
                    raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed "
                                       f"tensor ({tensor.device}), got {value.device}")
                if value.dtype == torch.bool:
                    raise RuntimeError("a boolean mask index on fake CUDA data has a data-dependent shape (and "
                                       "is a host sync on a real GPU): index with positions instead")
                return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            if isinstance(value, (tuple, list)):
                return type(value)(meta(v) for v in value)
            return value

        with unset_fake_temporarily():
            data = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
            out = data[meta(index)]
        return FakeTensor(self.mode, out, tensor.device)

    # ---- stream order ---------------------------------------------------------------------------------

    def _check_reads(self, func, args: tuple, kwargs: dict) -> None:
        """Raise where ``func`` reads data whose writer has not been waited for (see the module docstring)."""
        name = getattr(func, "__name__", "")
        if name in _NO_READ:
            return
        for tensor in _tensors_in((*args, *kwargs.values())):
            written = self.written.get(tensor)
            if written is None:
                continue
            stream, position = written
            device = _where(tensor)
            if stream.completed >= position:
                if device.type != "cuda":
                    del self.written[tensor]  # the copy has landed: an ordinary host tensor from now on
                continue
            if device.type != "cuda":
                raise StreamOrderError(
                    f"{name}() reads a host tensor that a non-blocking copy from {stream.device} may still be "
                    f"writing: no event recorded after the copy on {stream} (the copy's stream), nor that stream "
                    f"or the device, was waited for (record the event on torch.cuda.current_stream({stream.device}))")
            current = self.cuda.current_stream(device)
            if current is not stream and current.waited.get(stream, 0) < position:
                raise StreamOrderError(
                    f"{name}() on {current} uses {tensor.device} data that {stream} wrote, and {current} has not "
                    f"waited for it: call {current}.wait_event(event recorded on {stream} after the write) or "
                    f"wait_stream({stream})")

    def _note_writes(self, func, args: tuple, kwargs: dict, result: Any) -> None:
        """Queue what ``func`` did on the current streams, and remember which stream wrote each result."""
        inputs = list(_tensors_in((*args, *kwargs.values())))
        outputs = list(_tensors_in(result if isinstance(result, (list, tuple)) else (result,)))
        name = getattr(func, "__name__", "")
        if name in _NO_READ:  # a view or a detached alias has its source's writer
            source = next((self.written.get(t) for t in inputs if t in self.written), None)
            if source is not None:
                for out in outputs:
                    self.written[out] = source
            return
        gpus = [_where(t) for t in (*inputs, *outputs) if _where(t).type == "cuda"]
        if not gpus:
            return
        stream = self.cuda.current_stream(gpus[0])  # the device guard is the data's device
        position = stream.enqueue()
        host_outputs = [o for o in outputs if _where(o).type == "cpu"]
        from_gpu = any(_where(t).type == "cuda" for t in inputs)
        non_blocking = func in (torch.Tensor.to, torch.Tensor.copy_) and (
            bool(kwargs.get("non_blocking")) or any(a is True for a in args[1:3]))
        for out in outputs:
            where = _where(out)
            if where.type == "cuda":
                other = self.cuda.current_stream(where)
                self.written[out] = (other, position if other is stream else other.enqueue())
        if host_outputs and from_gpu:
            if non_blocking:  # the host gets the buffer now; the GPU fills it when the stream gets there
                for out in host_outputs:
                    self.written[out] = (stream, position)
            else:  # a blocking copy to the host waits for its stream first
                stream.completed = max(stream.completed, position)

    # ---- dispatch -------------------------------------------------------------------------------------

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not (_touches_gpu(args, kwargs) or func is torch.Tensor.cuda):
            return self._call(func, args, kwargs)  # host work: real tensors, any thread at once
        # one thread at a time in the fake mode (it keeps per-call state on itself, not per thread)
        with self._lock:
            self._check_reads(func, args, kwargs)
            result = self._call(func, args, kwargs)
            self._note_writes(func, args, kwargs, result)
            return result

    def _call(self, func, args: tuple, kwargs: dict) -> Any:
        if func is torch.Tensor.to:
            moved = self._to(args, kwargs)
            if moved is not None:
                return moved
        elif func is torch.Tensor.cuda:
            device = args[1] if len(args) > 1 else kwargs.get("device", "cuda")
            device = torch.device("cuda", device) if isinstance(device, int) else device
            if args[0].device != _device(device):
                return self._fake(args[0], _device(device), None)
            return args[0]
        elif func is torch.Tensor.cpu:
            if args[0].device.type == "cuda":
                return self._fake(args[0], torch.device("cpu"), None)
        elif func is torch.Tensor.copy_ and "cuda" in (args[0].device.type, args[1].device.type):
            # legal between devices too (a CPU build cannot dispatch it on CUDA); the values are fake anyway
            if torch.broadcast_shapes(args[0].shape, args[1].shape) != args[0].shape:
                raise RuntimeError(f"copy_: the source's shape {tuple(args[1].shape)} does not broadcast to "
                                   f"the destination's {tuple(args[0].shape)}")
            return args[0]
        elif func is torch.Tensor.__getitem__ and args[0].device.type == "cuda":
            return self._getitem(args[0], args[1])
        elif func is torch.Tensor.__setitem__ and args[0].device.type == "cuda":
            self._getitem(args[0], args[1])  # the same index checks; the values are fake
            return None
        elif func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None:
            target = _device(kwargs["device"])
            if target.type == "cuda":  # data copied onto a GPU: made on the host, then moved
                with torch.no_grad():
                    host = func(*args, **{**kwargs, "device": "cpu"})
                return self._fake(host, target, None)
        elif func is torch.Tensor.__invert__ and args[0].device.type == "cuda":
            return torch.bitwise_not(args[0])  # what ``~x`` is; its Python entry enters the missing device guard
        elif func is torch.Tensor.pin_memory:
            return self._pin(args[0])
        elif func is torch.Tensor.is_pinned:
            return args[0] in self.pinned
        if func in (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad):
            raise RuntimeError(
                "backward on fake CUDA tensors would abort this process (a CPU build of torch has no CUDA device "
                "guard for the autograd engine): call the Function's forward/backward directly, or run the "
                "backward on the meta device"
            )
        if not _touches_gpu(args, kwargs):  # host work (data loading, a sampler, a seed) runs for real, on values
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():
                return func(*args, **kwargs)
        # Recording an autograd node on a fake CUDA tensor aborts the process for the same reason:
        # every call runs without a graph (placement and shapes are what this mode proves).
        with torch.no_grad():
            return func(*args, **kwargs)

    def _pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Page-locked host memory needs a driver; what torch checks first is faked faithfully: the CPU only."""
        if tensor.device.type != "cpu":
            kind = {torch.float32: "FloatTensor", torch.float64: "DoubleTensor", torch.int64: "LongTensor"}.get(
                tensor.dtype, f"{str(tensor.dtype).removeprefix('torch.')} tensor")
            raise RuntimeError(f"cannot pin 'torch.{tensor.device.type}.{kind}' only dense CPU tensors can be pinned")
        self.pinned[tensor] = True
        self.cuda.pinned += 1
        return tensor


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


def _record_stream(tensor: torch.Tensor, stream: Any) -> None:
    """``Tensor.record_stream`` (its argument parser takes only torch's own streams, so it is replaced)."""
    if not isinstance(stream, _Stream):
        raise TypeError(f"record_stream() needs a torch.cuda.Stream, got {type(stream).__name__}")
    if _where(tensor) != stream.device:
        raise RuntimeError(f"record_stream: a {_where(tensor)} tensor cannot be recorded on {stream}")


def _refuse_runtime(name: str):
    def call(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"fake_cuda: torch.cuda.{name}() would start the real CUDA runtime (a CPU build has "
                           "none, a CUDA build without a driver fails there): fake the torch.cuda call that led here")
    return call


_FAKED = ("device_count", "current_device", "set_device", "synchronize", "get_rng_state", "set_rng_state",
          "get_rng_state_all", "set_rng_state_all", "manual_seed", "manual_seed_all", "get_device_properties",
          "get_device_capability", "get_device_name", "is_bf16_supported", "current_stream", "default_stream",
          "set_stream", "stream", "Stream", "Event", "memory_allocated", "mem_get_info")


def _cuda_patches(cuda: FakeCuda, devices: int) -> list:
    """Every ``torch.cuda`` / ``torch.accelerator`` entry the code under test (and torch on its behalf) reaches."""
    patches = [mock.patch(f"torch.cuda.{name}", getattr(cuda, name)) for name in _FAKED]
    patches += [
        mock.patch("torch.cuda.is_available", lambda: devices > 0),
        mock.patch("torch.cuda.is_initialized", lambda: True),
        mock.patch("torch.cuda.max_memory_allocated", cuda.memory_allocated),
        mock.patch("torch.cuda.reset_peak_memory_stats", lambda device=None: None),
        mock.patch("torch.cuda.empty_cache", lambda: None),
        mock.patch("torch.cuda.is_current_stream_capturing", lambda: False),  # asked by every optimizer step
        mock.patch("torch.cuda.random.get_rng_state", cuda.get_rng_state),
        mock.patch("torch.cuda.random.set_rng_state", cuda.set_rng_state),
        mock.patch.object(torch.Tensor, "record_stream", _record_stream),
        mock.patch("torch.cuda._lazy_init", _refuse_runtime("_lazy_init")),
        mock.patch("torch.cuda.init", _refuse_runtime("init")),
        # torch.accelerator: DataLoader's pinning, init_process_group's device_id check
        mock.patch("torch.accelerator.is_available", lambda: devices > 0),
        mock.patch("torch.accelerator.device_count", lambda: devices),
        mock.patch("torch.accelerator.current_accelerator",
                   lambda check_available=False: torch.device("cuda") if devices > 0 else None),
        mock.patch("torch.accelerator.current_device_index", cuda.current_device),
        mock.patch("torch.accelerator.set_device_index", cuda.set_device),
        mock.patch("torch.accelerator.synchronize", cuda.synchronize),
        mock.patch("torch.accelerator.current_stream", cuda.current_stream),  # an optimizer step asks it
        mock.patch("torch.accelerator.set_stream", cuda.set_stream),
    ]
    return patches


@contextlib.contextmanager
def fake_cuda(devices: int = 1, *, tensors: bool = True, capability: tuple[int, int] = (9, 0)) -> Iterator[FakeCuda]:
    """Run the block as on a host with ``devices`` visible GPUs, on a CPU-only machine.

    Args:
        devices: How many GPUs ``torch.cuda.device_count()`` reports.
        tensors: Also enter ``FakeTensorMode`` (every tensor made inside is fake; ``device="cuda"``
            works and mixed devices raise). ``False`` fakes only the ``torch.cuda`` facts, for code
            that asks about devices without making CUDA tensors (placement, RNG state bookkeeping).
        capability: The compute capability ``torch.cuda.get_device_properties``/``get_device_capability`` report
            (and so ``torch.cuda.is_bf16_supported``).

    Yields:
        A :class:`FakeCuda` that records ``set_device``, ``synchronize``, RNG-state calls, streams made and
        ``torch.cuda.Event`` records and waits.
    """
    cuda = FakeCuda(devices=devices, capability=capability)
    with contextlib.ExitStack() as stack:
        for patch in _cuda_patches(cuda, devices):
            stack.enter_context(patch)
        if tensors:
            from torch._subclasses import fake_tensor

            # never a real device: FakeTensorMode makes a tensor on the "GPU" to start a context, and constant-
            # folds through real devices when torch.cuda.is_available() says True
            stack.enter_context(mock.patch.object(fake_tensor, "init_gpu_context", lambda device: None))
            stack.enter_context(mock.patch.object(fake_tensor.FakeTensorMode, "avoid_device_init",
                                                  property(lambda self: True)))
            mode = stack.enter_context(fake_tensor.FakeTensorMode(allow_non_fake_inputs=True))
            # no dispatch cache: its key holds ``device="cuda"`` as written, not the device it meant when cached
            mode.cache_enabled = False
            moves = stack.enter_context(_CudaMoves(mode, cuda))
            stack.enter_context(_in_new_threads(mode, moves))
            stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", _apply_in_place))
        yield cuda


def _in_new_threads(*modes):
    """Threads started inside the block run under ``modes`` too (torch's modes are per thread): a data
    prefetcher's or a receiver's work is faked as the main thread's is."""
    real_run = threading.Thread.run

    def run(self: threading.Thread) -> None:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            real_run(self)

    return mock.patch.object(threading.Thread, "run", run)


def _apply_in_place(self: torch.nn.Module, fn, recurse: bool = True) -> torch.nn.Module:
    """``Module._apply`` as a real move does it: each Parameter object stays (its data changes in place), so an
    optimizer built before the move keeps its parameters and a weight shared by two modules stays shared.

    torch sets ``param.data`` where the old and new tensors are of compatible kinds (a CPU tensor and a CUDA
    one are) and makes a new Parameter otherwise (a real tensor and a fake one are not): here a fake result is
    swapped into the same Python object (``torch.utils.swap_tensors``) instead."""
    if recurse:
        for module in self.children():
            module._apply(fn)
    for param in self._parameters.values():
        if param is None:
            continue
        with torch.no_grad():
            applied = fn(param)
        if applied is not param:
            _set_in_place(param, applied)
        if param.grad is not None:
            with torch.no_grad():
                grad = fn(param.grad)
            if grad is not param.grad:
                _set_in_place(param.grad, grad)
    for key, buf in self._buffers.items():
        if buf is not None:
            self._buffers[key] = fn(buf)
    return self


def _set_in_place(tensor: torch.Tensor, applied: torch.Tensor) -> None:
    if not is_fake(applied) and not is_fake(tensor):
        tensor.data = applied
        return
    if is_fake(tensor):  # made inside the mode (the mode holds a weak reference to it: no swap)
        tensor.data = applied
        tensor.fake_device = applied.device
        return
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    is_param = isinstance(tensor, torch.nn.Parameter)
    with unset_fake_temporarily():
        meta = torch.empty_strided(applied.shape, applied.stride(), dtype=applied.dtype, device="meta")
    fresh = FakeTensor(applied.fake_mode, meta, applied.device)  # no weak reference yet: it can be swapped
    fresh.requires_grad_(tensor.requires_grad)
    torch.utils.swap_tensors(tensor, fresh)
    if is_param:
        tensor._is_param = True  # isinstance(tensor, nn.Parameter) holds, as for a fake Parameter torch makes


@contextlib.contextmanager
def fake_group(rank: int = 0, world_size: int = 2) -> Iterator[None]:
    """A ``fake`` process group: every collective returns at once, as rank ``rank`` of ``world_size``.

    The collectives move no data (an ``all_reduce`` leaves the tensor as it was), so a test
    proves what runs between collectives (devices, shapes, which collectives are called), not
    their results. ``multigpu``'s own runtime state is left alone: use the group directly, or
    pass ``world_size``/``rank`` to the code under test.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_group() needs no process group to be initialized already")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_init(rank: int = 0, world_size: int = 2) -> Iterator[list[tuple[str, dict]]]:
    """Let a job's own ``init_process_group`` / ``new_group`` calls run, answered by the ``fake`` backend.

    Whatever backend they ask for (``"cpu:gloo,cuda:nccl"``, ``"gloo"``) and however they meet (``env://``, a
    ``file://`` store), the group is made by the ``fake`` backend as rank ``rank`` of ``world_size``, with the
    rest of the arguments as given (a ``device_id`` is checked and bound as torch does). Yields the list of
    ``(function name, the arguments it was called with)``, so a test sees what an NCCL job asked for.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    calls: list[tuple[str, dict]] = []
    real_init, real_new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, init_method=None, **kwargs):
        calls.append(("init_process_group", {"backend": backend, "init_method": init_method, **kwargs}))
        kwargs.update(store=FakeStore(), rank=rank, world_size=world_size)
        return real_init("fake", **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, **kwargs):
        calls.append(("new_group", {"ranks": ranks, "timeout": timeout, "backend": backend, **kwargs}))
        return real_new_group(ranks, timeout, "fake", **kwargs)

    if dist.is_initialized():
        raise RuntimeError("fake_init() needs no process group to be initialized already")
    try:
        with mock.patch.object(dist, "init_process_group", init_process_group), \
                mock.patch.object(dist, "new_group", new_group):
            yield calls
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()



class CudaInitialized(BaseException):
    """What :func:`forbid_cuda_init` raises where code would create a CUDA context. A ``BaseException``, so that
    no ``except Exception`` (a capability probe's fallback, say) in the code under test can swallow it."""


_CONTEXT_ENTRY_POINTS = ("init", "_lazy_init", "set_device", "current_device", "synchronize", "get_device_capability",
                         "get_device_properties", "get_device_name", "mem_get_info", "memory_allocated",
                         "max_memory_allocated", "is_bf16_supported", "get_rng_state", "set_rng_state",
                         "get_rng_state_all", "set_rng_state_all", "empty_cache", "current_stream", "Stream", "Event")
"""``torch.cuda`` functions that initialize CUDA (a context on the current GPU). Left alone: ``is_available`` and
``device_count`` (they ask the driver, no context) and the seeds (queued until CUDA starts)."""


class _NoCudaTensors(torch.overrides.TorchFunctionMode):
    """Raise :class:`CudaInitialized` for any torch call that places a tensor or module on CUDA."""

    @staticmethod
    def _cuda(value: Any) -> bool:
        if isinstance(value, torch.device):
            return value.type == "cuda"
        if isinstance(value, str):
            return value.split(":")[0] == "cuda"
        if isinstance(value, torch.Tensor):
            return value.device.type == "cuda"
        return False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda or any(self._cuda(v) for v in (*args, *kwargs.values())):
            raise CudaInitialized(f"{getattr(func, '__name__', func)} would place a tensor on CUDA")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_cuda_init(devices: int = 8) -> Iterator[None]:
    """Run the block as on a host with ``devices`` GPUs where nothing may create a CUDA context.

    ``torch.cuda.is_available()`` and ``device_count()`` answer as that host does (they need no context); every
    ``torch.cuda`` entry point that would create one, and any tensor or module placed on CUDA, raises
    :class:`CudaInitialized` naming what was called. For the launcher's side: a context there would hold
    memory on GPU 0 for the whole job, and fail on GPUs in exclusive-process mode.
    """
    def refuse(name: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            raise CudaInitialized(f"torch.cuda.{name} would create a CUDA context")
        return call

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.is_available", lambda: devices > 0))
        stack.enter_context(mock.patch("torch.cuda.device_count", lambda: devices))
        for name in _CONTEXT_ENTRY_POINTS:
            stack.enter_context(mock.patch(f"torch.cuda.{name}", refuse(name)))
        stack.enter_context(_NoCudaTensors())
        yield
