"""Fake CUDA on a CPU-only machine: prove device placement without a GPU.

Runs inside the test process (no ranks, no launcher). Two pieces of torch do the work:

* ``FakeTensorMode`` makes ``device="cuda"`` tensors that hold no data and raise on
  mixed devices exactly as CUDA does (``index_add`` with a CPU index into CUDA data:
  "expected to be in the same device"; a CPU weight times a CUDA input: "Expected all
  tensors to be on the same device").
* the ``fake`` process-group backend (``FakeStore``) runs every collective at any world
  size in one process, so the code between collectives runs as rank ``r`` of ``N``.

What a CPU build of torch cannot fake, and this module therefore patches or cannot do:

* ``Tensor.to("cuda")``, ``.cuda()``, ``Module.to("cuda")`` and a copy between devices
  call into torch's C++ device guard, which a CPU build lacks ("PyTorch is not linked with
  support for cuda devices"). :class:`_CudaMoves` (a ``TorchFunctionMode``) answers them
  with a fake tensor on the target device. Indexing CUDA data with a CPU index tensor is
  legal on CUDA (the index is moved) and emulated the same way.
* **Backward on fake CUDA tensors aborts the process** (the autograd engine asks the
  missing CUDA guard for a stream, in its own thread, and ``std::terminate`` follows).
  Code whose device placement matters in a backward pass is tested by calling its
  forward/backward functions directly (``Function.backward(ctx, grad)``), never through
  ``loss.backward()`` inside :func:`fake_cuda`. :func:`fake_cuda` refuses a backward
  pass with an error instead of letting the test process die.
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
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

__all__ = ["CudaInitialized", "FakeCuda", "fake_cuda", "fake_group", "forbid_cuda_init", "is_fake"]


def _device(value: Any) -> torch.device:
    device = value if isinstance(value, torch.device) else torch.device(value)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def is_fake(tensor: Any) -> bool:
    """True for a tensor made under :func:`fake_cuda` (no data behind it)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class _CudaMoves(torch.overrides.TorchFunctionMode):
    """Answer the device moves a CPU build cannot dispatch with fake tensors on the target device."""

    def __init__(self, mode) -> None:
        super().__init__()
        self.mode = mode

    def _fake(self, like: torch.Tensor, device: torch.device, dtype: torch.dtype | None) -> torch.Tensor:
        from torch._subclasses.fake_tensor import FakeTensor

        meta = torch.empty_strided(like.shape, like.stride(), dtype=dtype or like.dtype, device="meta")
        out = FakeTensor(self.mode, meta, device)
        return out

    def _to(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        tensor, device, dtype = args[0], kwargs.get("device"), kwargs.get("dtype")
        for arg in args[1:]:
            if isinstance(arg, torch.Tensor):
                device, dtype = arg.device, arg.dtype
            elif isinstance(arg, torch.dtype):
                dtype = arg
            elif isinstance(arg, bool):
                continue  # non_blocking
            elif isinstance(arg, (str, torch.device, int)):
                device = arg if not isinstance(arg, int) else torch.device("cuda", arg)
        if device is None:
            return None
        target = _device(device)
        if target == tensor.device or "cuda" not in (target.type, tensor.device.type):
            return None
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

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
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
            return args[0]  # page-locked host memory needs a CUDA driver; the copy it speeds up is faked anyway
        if func in (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad):
            raise RuntimeError(
                "backward on fake CUDA tensors would abort this process (a CPU build of torch has no CUDA device "
                "guard for the autograd engine): call the Function's forward/backward directly instead"
            )
        # Recording an autograd node on a fake CUDA tensor aborts the process for the same reason:
        # every call runs without a graph (placement and shapes are what this mode proves).
        with torch.no_grad():
            return func(*args, **kwargs)


class _Event:
    """``torch.cuda.Event``: recording and waiting are counted on the :class:`FakeCuda` (the work is done already)."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.recorded = cuda, False

    def record(self, stream: Any = None) -> None:
        self.recorded = True
        self.cuda.events_recorded += 1

    def synchronize(self) -> None:
        if not self.recorded:
            raise RuntimeError("synchronize() on a CUDA event that was never recorded")
        self.cuda.events_synchronized += 1

    def query(self) -> bool:
        return True

    def wait(self, stream: Any = None) -> None:
        pass

    def elapsed_time(self, end: _Event) -> float:
        return 0.0  # milliseconds; the fake GPU takes no time


@dataclasses.dataclass
class FakeCuda:
    """What :func:`fake_cuda` yields: the faked ``torch.cuda`` facts and what the code asked of them."""

    devices: int
    capability: tuple[int, int] = (9, 0)
    """Compute capability every faked GPU reports (an H100's by default; (7, 0) is a V100: no bf16)."""
    current: int = 0
    synchronized: int = 0
    set_device_calls: list[int] = dataclasses.field(default_factory=list)
    rng_states: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    capability: tuple[int, int] = (9, 0)
    """``torch.cuda.get_device_capability()`` of every device (an H100's; torch's collectives ask for it)."""
    events_recorded: int = 0
    events_synchronized: int = 0

    def device_count(self) -> int:
        return self.devices

    def current_stream(self, device: Any = None) -> str:
        return f"stream of cuda:{self._index(device if device is not None else 'cuda')}"

    def Event(self, *args: Any, **kwargs: Any) -> _Event:  # noqa: N802 - torch.cuda.Event's name
        return _Event(self)

    def current_device(self) -> int:
        return self.current

    def set_device(self, device: Any) -> None:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if not 0 <= index < self.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({index} of {self.devices} visible)")
        self.set_device_calls.append(index)
        self.current = index

    def get_device_properties(self, device: Any = None) -> Any:
        import types

        self._index(self.current if device is None else device)
        major, minor = self.capability
        return types.SimpleNamespace(name="fake CUDA device", major=major, minor=minor, total_memory=80 << 30,
                                     multi_processor_count=132)

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        props = self.get_device_properties(device)
        return props.major, props.minor

    def synchronize(self, device: Any = None) -> None:
        self.synchronized += 1

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
        else:
            device = torch.device(device)
            index = self.current if device.index is None else device.index
        if not 0 <= index < self.devices:
            raise IndexError(f"CUDA device {index} is not visible ({self.devices} visible)")
        return index


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
        A :class:`FakeCuda` that records ``set_device``, ``synchronize``, RNG-state calls and
        ``torch.cuda.Event`` records and waits.
    """
    cuda = FakeCuda(devices=devices, capability=capability)
    names = ("device_count", "current_device", "set_device", "synchronize", "get_rng_state", "set_rng_state",
             "get_rng_state_all", "set_rng_state_all", "manual_seed", "manual_seed_all", "get_device_properties",
             "get_device_capability", "current_stream", "Event")
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.is_available", lambda: devices > 0))
        stack.enter_context(mock.patch("torch.cuda.is_initialized", lambda: True))
        for name in names:
            stack.enter_context(mock.patch(f"torch.cuda.{name}", getattr(cuda, name)))
        stack.enter_context(mock.patch("torch.cuda.random.get_rng_state", cuda.get_rng_state))
        stack.enter_context(mock.patch("torch.cuda.random.set_rng_state", cuda.set_rng_state))
        if tensors:
            from torch._subclasses.fake_tensor import FakeTensorMode

            mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(_CudaMoves(mode))
            stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", _apply_by_replacing))
        yield cuda


def _apply_by_replacing(self: torch.nn.Module, fn, recurse: bool = True) -> torch.nn.Module:
    """``Module._apply`` that puts new Parameters in place: torch swaps fake parameters in place
    (``swap_tensors``), which fails for fake tensors made inside the mode; replacing them is what
    ``Module.to`` does for ordinary tensors."""
    if recurse:
        for module in self.children():
            module._apply(fn)
    for key, param in self._parameters.items():
        if param is not None:
            with torch.no_grad():
                applied = fn(param)
            if applied is not param:  # unchanged (already there): the same Parameter, as an optimizer holds it
                self._parameters[key] = torch.nn.Parameter(applied, param.requires_grad)
    for key, buf in self._buffers.items():
        if buf is not None:
            self._buffers[key] = fn(buf)
    return self


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
