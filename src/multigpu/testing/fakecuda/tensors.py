"""Fake CUDA tensors: the moves a CPU build cannot dispatch, the streams' order, Module.to in place (in the test
process; see :mod:`multigpu.testing.fakecuda`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import torch

from multigpu.errors import StreamOrderError
from multigpu.testing.fakecuda.devices import FakeCuda, device_of

__all__ = ["CudaMoves", "is_fake", "module_apply_in_place"]


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


# metadata and bookkeeping calls: they read no data, so they wait for nothing
_NO_READ = {"__get__", "__set__", "size", "dim", "numel", "stride", "element_size", "is_pinned", "record_stream",
            "is_contiguous", "data_ptr", "nelement", "__len__", "is_floating_point", "__hash__", "__repr__",
            "__format__", "untyped_storage", "storage_offset", "requires_grad_", "detach", "__reduce_ex__"}


class CudaMoves(torch.overrides.TorchFunctionMode):
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
            device = device_of(tensor)
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
        gpus = [device_of(t) for t in (*inputs, *outputs) if device_of(t).type == "cuda"]
        if not gpus:
            return
        stream = self.cuda.current_stream(gpus[0])  # the device guard is the data's device
        position = stream.enqueue()
        host_outputs = [o for o in outputs if device_of(o).type == "cpu"]
        from_gpu = any(device_of(t).type == "cuda" for t in inputs)
        non_blocking = func in (torch.Tensor.to, torch.Tensor.copy_) and (
            bool(kwargs.get("non_blocking")) or any(a is True for a in args[1:3]))
        for out in outputs:
            where = device_of(out)
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


def module_apply_in_place(self: torch.nn.Module, fn, recurse: bool = True) -> torch.nn.Module:
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
