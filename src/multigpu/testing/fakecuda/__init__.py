"""Fake CUDA on a CPU-only machine: prove device placement without a GPU.

Runs inside the test process (no ranks, no launcher). ``tensors`` fakes the tensors and streams' order,
``devices`` the ``torch.cuda`` facts, ``groups`` the process groups. Two pieces of torch do the work:

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
  call into torch's C++ device guard, which a CPU build lacks. :class:`CudaMoves` (a
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
* **Autocast's weight cache is off** inside :func:`fake_cuda`: a cached cast is made with gradients on, an
  autograd node the fake cannot record. Autocast itself runs (its casts, its dtypes); what the cache saves is
  counted on the CPU, whose autocast runs the same code.
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
import threading
from collections.abc import Iterator
from typing import Any
from unittest import mock

import torch

from multigpu.errors import CudaInitialized, StreamOrderError
from multigpu.testing.fakecuda.devices import FakeCuda, record_stream
from multigpu.testing.fakecuda.groups import fake_group, fake_init, forbid_cuda_init
from multigpu.testing.fakecuda.tensors import CudaMoves, is_fake, module_apply_in_place

__all__ = ["CudaInitialized", "FakeCuda", "StreamOrderError", "fake_cuda", "fake_group", "fake_init",
           "forbid_cuda_init", "is_fake"]


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
        mock.patch.object(torch.Tensor, "record_stream", record_stream),
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
            moves = stack.enter_context(CudaMoves(mode, cuda))
            stack.enter_context(_in_new_threads(mode, moves))
            stack.enter_context(mock.patch.object(torch.nn.Module, "_apply", module_apply_in_place))
            stack.enter_context(_no_autocast_cache())
        yield cuda


@contextlib.contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """Autocast without its cache of cast weights: outside ``inference_mode`` the cache makes each cast with
    gradients on (an autograd node), which a fake CUDA tensor cannot have (see the module docstring). The casts
    then happen as on a GPU with the cache off; what the cache saves is counted on the CPU, whose autocast shares
    its code (tests/fakecuda/test_infer_envs_cuda.py)."""
    before = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(before)


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
