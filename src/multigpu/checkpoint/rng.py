"""This process's random state as a checkpoint part (``PerRank(RngState())``: every rank's own)."""

from __future__ import annotations

from typing import Any

__all__ = ["RngState"]


class RngState:
    """Python, NumPy, torch CPU and CUDA random state: ``state_dict()`` captures, ``load_state_dict()`` restores.

    The capture itself is the trainer's (one pair of functions, :func:`multigpu.train.checkpoint.capture_rng`
    and ``restore_rng``), so every workload saves the same thing.
    """

    def state_dict(self) -> dict[str, Any]:
        from multigpu.train.checkpoint import capture_rng

        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from multigpu.train.checkpoint import restore_rng

        restore_rng(state)
