"""What the last ``sliding_window`` call did on this rank: seconds per phase and bytes sent (inside each rank).

For benchmarks (``benchmarks/infer_vs_monai.py`` prints them per rank); each call clears both first. Nothing
here communicates.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

__all__ = ["EXCHANGE_STATS", "PHASE_SECONDS", "reset", "timed_phase"]

EXCHANGE_STATS: dict[str, int] = {}
"""Bytes this rank sent in the last ``sliding_window`` call: ``spill`` (window outputs), ``owned`` (voxels to rank 0)."""
PHASE_SECONDS: dict[str, float] = {}
"""Wall seconds this rank spent per phase of the last ``sliding_window`` call: ``cut`` (windows cut and stacked),
``model``, ``blend`` (window outputs added into the canvas), ``idle`` (waiting for the slowest rank to finish its
windows), ``spill`` (the exchange of window outputs), ``assemble`` (rank 0 writing its own voxels into the
output), ``gather`` (the owned voxels sent to rank 0 and placed there; includes waiting). For benchmarks."""


def reset() -> None:
    """Forget the previous call's figures (``sliding_window`` calls it first)."""
    EXCHANGE_STATS.clear()
    PHASE_SECONDS.clear()


@contextlib.contextmanager
def timed_phase(name: str) -> Iterator[None]:
    """Add the wall seconds of the block to ``PHASE_SECONDS[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        PHASE_SECONDS[name] = PHASE_SECONDS.get(name, 0.0) + time.perf_counter() - start
