"""Staging: a checkpoint's state copied to host memory, so the run can go on while a thread writes it (inside
each rank).

A background save must write the state *as it was* at its step while the next steps change the model in
place, so the state is copied first, on the main thread, between two steps; that copy is the only time a
background save takes from the run. :class:`Stager` copies:

* plain values and every rank's own parts (written by rank 0 with ``torch.save``): tensors into host buffers
  kept from one save to the next (pinned on a GPU, so the copy from the device runs at full speed and, queued
  without blocking, all of them overlap), everything else deep-copied. On a GPU the run does not even wait for
  those copies: they are queued on the streams the next step's kernels follow them on, so they read the state
  as it was, and the writer waits for them (a CUDA event per device) before it reads the host buffers;
* the sharded parts (DTensors, written by every rank with ``torch.distributed.checkpoint``): by DCP's own
  stager, ``torch.distributed.checkpoint.staging.BlockingAsyncStager``, the one ``dcp.async_save`` stages
  with, which keeps each DTensor's layout around its copied local shard (pinned and cached on GPUs).

A staged copy costs host memory: one more copy of what the rank checkpoints (its parameters, optimizer state,
random state, ...), kept between saves so that the pinned buffers are allocated once. Where the host cannot
hold it, save synchronously (``checkpoint_mode=sync``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

__all__ = ["Stager", "landed"]


class Stager:
    """Copies of state dicts in host memory, with buffers kept from one call to the next (see the module)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._sharded = None  # DCP's stager, made on the first sharded part
        self._devices: set[torch.device] = set()
        self._seen: dict[tuple, torch.Tensor] = {}
        self._used: set[tuple] = set()

    def stage(self, value: Any, *, wait: bool = True) -> tuple[Any, list]:
        """A copy of ``value`` (a state dict, nested dicts, lists, tuples, tensors, plain values) that shares
        no memory with it, tensors in host memory; and the CUDA events that say when its device copies have
        landed (empty without a GPU).

        ``wait``: return once the copies have landed. False: return as soon as they are queued; whoever reads
        the copy first waits for the events (:func:`landed`). The run may go on meanwhile: its next kernels
        are queued on the same streams after the copies, so the copies read the state as it was."""
        self._devices, self._seen, self._used = set(), {}, set()
        try:
            out = self._copy(value, ())
        finally:
            self._seen = {}
        # buffers no tensor of this save used (a shape that changed) are let go
        self._buffers = {k: v for k, v in self._buffers.items() if k in self._used}
        events = []
        for device in self._devices:  # one event per device, after its copies on its current stream
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        if wait:
            landed(events)
            events = []
        return out, events

    def stage_sharded(self, states: dict[str, Any]) -> dict[str, Any]:
        """A host copy of DCP state dicts (DTensors keep their mesh and placements; their local shards are
        copied), made by DCP's stager as ``dcp.async_save`` makes it."""
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        if self._sharded is not None:
            try:
                return self._sharded.stage(states)
            except (KeyError, RuntimeError, ValueError):  # the layout changed since the copy was made: a new one
                self._sharded = None
        # cache_staged_state_dict: the host copy is kept and refilled by later saves, in pinned memory;
        # pinning needs CUDA, so on the CPU every save gets a fresh (unpinned) copy instead
        self._sharded = BlockingAsyncStager(cache_staged_state_dict=_uses_cuda(states))
        return self._sharded.stage(states)

    # ------------------------------------------------------------------ plain values
    def _copy(self, value: Any, path: tuple) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if isinstance(value, dict):
            out = type(value)() if type(value) is not dict else {}
            for key, item in value.items():
                out[key] = self._copy(item, (*path, key))
            if getattr(value, "__dict__", None):  # a module's state dict carries its version table (_metadata)
                out.__dict__.update(copy.deepcopy(value.__dict__))
            return out
        if isinstance(value, list):
            return [self._copy(item, (*path, i)) for i, item in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self._copy(item, (*path, i)) for i, item in enumerate(value))
        return copy.deepcopy(value)  # numbers, strings, NumPy arrays, named tuples: nothing shared with the run

    def _tensor(self, tensor: torch.Tensor, path: tuple) -> torch.Tensor:
        tensor = tensor.detach()
        if hasattr(tensor, "device_mesh"):  # a DTensor in a plain part: copied as it is, layout and all
            return tensor.to("cpu", copy=True)
        # the same memory under two names (tied weights) stays one tensor, as torch.save stores it once
        view = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and view in self._seen:
            return self._seen[view]
        cuda = tensor.device.type == "cuda"
        key = (path, tensor.dtype, tuple(tensor.shape))
        buffer = self._buffers.get(key)
        self._used.add(key)
        if buffer is None:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            if cuda:  # page-locked, once: a copy from the GPU into it runs at full speed and without blocking
                buffer = buffer.pin_memory()
            self._buffers[key] = buffer
        if cuda:
            self._devices.add(tensor.device)
        buffer.copy_(tensor, non_blocking=cuda)  # into pinned memory: queued, overlapping the other copies
        self._seen[view] = buffer
        return buffer



def landed(events: list) -> None:
    """Wait until the device copies behind ``events`` (from :meth:`Stager.stage`) are in host memory."""
    for event in events:
        event.synchronize()


def _uses_cuda(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == "cuda"
    if isinstance(value, dict):
        return any(_uses_cuda(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_uses_cuda(v) for v in value)
    return False
