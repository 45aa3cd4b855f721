"""This process's random state as a checkpoint part (``PerRank(RngState())``: every rank's own)."""

from __future__ import annotations

from typing import Any

from multigpu.runtime.rng import capture_rng, restore_rng

__all__ = ["RngState"]


class RngState:
    """Python, NumPy, torch CPU and CUDA random state: ``state_dict()`` captures, ``load_state_dict()`` restores.

    The capture itself is one pair of functions (:func:`multigpu.runtime.rng.capture_rng` and ``restore_rng``:
    the current GPU's generator only), so every workload saves the same thing.
    """

    def state_dict(self) -> dict[str, Any]:
        return capture_rng()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(state)
