"""DataLoader samplers for ranks (inside each rank; pure index math, no communication).

* :class:`ShardSampler` - inference: every index exactly once over all ranks,
  contiguous per rank, no padding (ranks may get counts differing by one).
* :class:`TrainSampler` - training: every rank gets the same number of indices
  each epoch (so no rank waits in a gradient all-reduce another never starts),
  a fresh shuffle per epoch *without* ``set_epoch``: each ``iter()`` starts the
  next epoch. Ranks take strided slices of the permutation, so global batch
  ``t`` of a run on W ranks holds the same samples as batch ``t`` of a
  one-rank run with a W times larger batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from multigpu.errors import ConfigError
from multigpu.runtime.sharding import rank_and_world_size, shard_bounds

__all__ = ["ShardSampler", "TrainSampler"]


def _length(data: Sized | int) -> int:
    n = data if isinstance(data, int) else len(data)
    if n < 0:
        raise ConfigError(f"dataset length {n} must be >= 0")
    return n


class ShardSampler(Sampler[int]):
    """This rank's contiguous indices of ``range(len(data))``; all ranks together see each once.

    Example (world_size=2, 5 items)::

        list(ShardSampler(5))   # rank 0 -> [0, 1, 2]; rank 1 -> [3, 4]
    """

    def __init__(self, data: Sized | int, *, rank: int | None = None, world_size: int | None = None):
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
        self.start, self.stop = shard_bounds(_length(data), self.rank, self.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


class TrainSampler(Sampler[int]):
    """Equal-length, per-epoch-shuffled indices for this rank; epochs advance by themselves.

    Args:
        data: The dataset (or its length).
        shuffle: A new permutation each epoch, the same on every rank (seeded by ``seed + epoch``).
        seed: Base seed of the permutation.
        drop_last: True (default): drop the last ``len % world_size`` samples of
            each permutation so ranks stay equal. False: wrap around and repeat
            the first samples instead (every sample is used, some twice).

    Example (world_size=2, 5 items, shuffle=False)::

        list(TrainSampler(5, shuffle=False))   # rank 0 -> [0, 2]; rank 1 -> [1, 3]
    """

    def __init__(
        self,
        data: Sized | int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        self.rank, self.world_size = rank_and_world_size(rank, world_size)
        self.n = _length(data)
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if drop_last:
            self.num_samples = self.n // self.world_size
        else:
            self.num_samples = -(-self.n // self.world_size)
        if self.num_samples == 0:
            raise ConfigError(
                f"dataset of {self.n} samples is too small for {self.world_size} ranks "
                f"(drop_last={drop_last}); need at least {self.world_size}"
            )
        self.epoch = 0
        """The epoch the next ``iter()`` will produce."""
        self._offset = 0

    def indices(self, epoch: int) -> list[int]:
        """This rank's full index list for ``epoch`` (pure; used by ``__iter__`` and tests)."""
        if self.shuffle:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.n, generator=gen).tolist()
        else:
            order = list(range(self.n))
        total = self.num_samples * self.world_size
        while len(order) < total:  # drop_last=False: wrap around
            order += order[: total - len(order)]
        return order[self.rank : total : self.world_size]

    def __iter__(self) -> Iterator[int]:
        epoch, offset = self.epoch, self._offset
        self.epoch += 1
        self._offset = 0
        return iter(self.indices(epoch)[offset:])

    def __len__(self) -> int:
        return self.num_samples - self._offset

    def state_dict(self, consumed: int = 0) -> dict[str, Any]:
        """Where to resume: the epoch in progress and ``consumed`` samples of it already used.

        Call after the epoch started (``iter()``), with the samples this rank has consumed in it.
        """
        return {"epoch": max(self.epoch - 1, 0), "offset": consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next ``iter()`` continue epoch ``state['epoch']`` after ``state['offset']`` samples."""
        self.epoch = int(state["epoch"])
        self._offset = int(state["offset"])
        self.seed = int(state.get("seed", self.seed))
        if not 0 <= self._offset <= self.num_samples:
            raise ConfigError(f"sampler offset {self._offset} is outside [0, {self.num_samples}]")
