"""Many replicates of a small model at once in one engine: a batch of populations (inside each rank).

Placeholder: no model has a batched form yet, so every replicate runs in an engine of its own.
"""

from __future__ import annotations

__all__ = ["auto_batch", "run_batch", "supports"]


def supports(cfg) -> bool:
    return False


def auto_batch(cfg) -> int:
    return 1


def run_batch(cfg, seeds):
    raise NotImplementedError
