"""Endless training batches over epochs, each tagged with where the sampler stands (inside each rank).

``BatchStream`` wraps a DataLoader over :class:`multigpu.TrainSampler` (equal
batches on every rank; each new pass over the loader starts the next epoch by
itself). Each batch comes with the sampler position *after* it, so a
checkpoint records what the training loop consumed, not what a background
prefetcher or DataLoader workers already fetched. With ``prefetch=N`` a
background thread moves the next N batches to the device ahead of use (on CUDA
on a side stream). On CUDA, host tensors are copied from page-locked (pinned) memory
unless ``pin_memory=False``; tensors a dataset returns on a GPU already are never pinned.

With ``shard=False`` the dataset is this rank's own shard, already split by the
user, and ranks may hold different numbers of samples. A rank that ran out of
batches while another still had some would leave the other waiting in DDP's
gradient all-reduce forever; so the stream learns every rank's batch count once
(one small all-gather at construction) and every epoch stops, on every rank,
after the *shortest* rank's count; the longer ranks' surplus batches (a fresh
random subset each epoch) are skipped, and rank 0 says how many.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

import multigpu as mg
from multigpu.errors import ConfigError

__all__ = ["BatchStream", "to_device"]

_DONE = object()


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) tuple/list/dict batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, non_blocking) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, (list, tuple)):
        for b in batch:
            yield from _tensors(b)
    elif isinstance(batch, dict):
        for b in batch.values():
            yield from _tensors(b)


def _common_batch_count(num_samples: int, batch_size: int) -> int:
    """Full batches per epoch that every rank has: the minimum over ranks. Call on all ranks."""
    counts = mg.gather(num_samples // batch_size, dst=None)
    least = min(counts)
    listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
    if least == 0:
        raise ConfigError(
            f"a rank has no full batch of batch_size={batch_size} in its own data (full batches per rank: "
            f"{listing}); give every rank at least batch_size samples, or use a smaller batch"
        )
    if least != max(counts) and mg.is_main():
        print(f"uneven data: full batches per epoch differ between ranks ({listing}); every epoch runs "
              f"{least} on each rank and skips the rest ({sum(counts) - least * len(counts)} batches in all), "
              "so no rank waits for another", flush=True)
    return least


class BatchStream:
    """``next(stream) -> (batch_on_device, sampler_state_after_it)``, forever, over epochs."""

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int,
        *,
        device: torch.device,
        seed: int = 0,
        num_workers: int = 0,
        prefetch: int = 0,
        collate_fn: Callable | None = None,
        sampler_state: dict | None = None,
        shard: bool = True,
        pin_memory: bool = True,
    ):
        if shard:
            self.sampler = mg.TrainSampler(dataset, seed=seed)
            self.batches_per_epoch = self.sampler.num_samples // batch_size
            if self.batches_per_epoch == 0:
                raise ConfigError(
                    f"each rank gets {self.sampler.num_samples} samples per epoch, fewer than batch_size={batch_size}; "
                    "use a smaller batch or more data"
                )
        else:  # this rank's own data: shuffled on its own, epochs cut to the shortest rank's batch count
            self.sampler = mg.TrainSampler(dataset, seed=seed, rank=0, world_size=1)
            self.batches_per_epoch = _common_batch_count(len(self.sampler), batch_size)
        if sampler_state is not None:
            self.sampler.load_state_dict(sampler_state)
        self.batch_size = batch_size
        self.device = device
        on_gpu = device.type == "cuda"
        # pinned here, not by the DataLoader (which pins every tensor, and crashes on one already on a GPU)
        self.pin = on_gpu and pin_memory
        self.loader = DataLoader(
            dataset, batch_size=batch_size, sampler=self.sampler, drop_last=True, num_workers=num_workers,
            collate_fn=collate_fn, persistent_workers=num_workers > 0,
            generator=torch.Generator().manual_seed(seed),  # never draws from the global RNG (exact resume)
        )
        self._tagged = self._tagged_batches()
        self._queue: queue.Queue | None = None
        self._stop = threading.Event()
        if prefetch > 0:
            self._stream = torch.cuda.Stream(device) if on_gpu else None
            self._queue = queue.Queue(maxsize=prefetch)
            self._thread = threading.Thread(target=self._fill, name="multigpu-prefetch", daemon=True)
            self._thread.start()

    def _tagged_batches(self) -> Iterator[tuple[Any, dict]]:
        while True:
            epoch, start = self.sampler.epoch, self.sampler.num_samples - len(self.sampler)
            used, end = 0, self.batches_per_epoch * self.batch_size
            if start >= end:  # resumed right after an epoch's last batch: that epoch is over
                iter(self.sampler)
                continue
            for batch in self.loader:  # starting this pass starts the sampler's next epoch
                used += self.batch_size
                yield batch, {"epoch": epoch, "offset": start + used, "seed": self.sampler.seed}
                if start + used >= end:  # every rank ends its epoch after the same number of batches
                    break

    def _move(self, batch: Any) -> tuple[Any, Any]:
        if self._queue is not None and self._stream is not None:
            # a dataset that returns GPU tensors made them on this thread's current stream: wait for that work
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                moved = to_device(self._pinned(batch), self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            return moved, event
        return to_device(batch, self.device), None

    def _pinned(self, batch: Any) -> Any:
        """The batch's host tensors in page-locked memory (a non-blocking copy from there overlaps compute);
        tensors already on a GPU, or all of them with ``pin_memory=False``, as they are."""
        if not self.pin:
            return batch
        if isinstance(batch, torch.Tensor):
            return batch.pin_memory() if batch.device.type == "cpu" else batch
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._pinned(b) for b in batch)
        if isinstance(batch, dict):
            return {k: self._pinned(v) for k, v in batch.items()}
        return batch

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                batch, state = next(self._tagged)
                item = (*self._move(batch), state)
                while not self._stop.is_set():
                    try:
                        self._queue.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self._queue.put((_DONE, exc, None))

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> tuple[Any, dict]:
        if self._queue is None:
            batch, state = next(self._tagged)
            # from pinned memory, on the current stream: ordered before the step's kernels, no host wait
            return to_device(self._pinned(batch), self.device, non_blocking=self.pin), state
        batch, event, state = self._queue.get()
        if batch is _DONE:
            raise event
        if event is not None:  # the copy ran on a side stream: wait for it, and keep the memory alive
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for t in _tensors(batch):
                t.record_stream(current)
        return batch, state

    def close(self) -> None:
        """Stop the prefetch thread (it finishes the batch in hand)."""
        self._stop.set()
        if self._queue is not None:
            self._thread.join(timeout=5)
