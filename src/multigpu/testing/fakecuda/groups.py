"""Fake process groups, and the launcher's guard against CUDA contexts (in the test process; see
:mod:`multigpu.testing.fakecuda`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from multigpu.errors import CudaInitialized


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
