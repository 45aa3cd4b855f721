"""Test utilities, shipped so users test their distributed code as multigpu tests its own."""

from multigpu.errors import RankFailedError
from multigpu.testing.markers import requires_backend, requires_gpus
from multigpu.testing.spawn import run_on_ranks

__all__ = ["RankFailedError", "requires_backend", "requires_gpus", "run_on_ranks"]
