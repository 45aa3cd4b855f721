"""BenchConfig: what ``multigpu bench`` runs (runs in the launcher)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from multigpu.errors import ConfigError

__all__ = ["BenchConfig", "parse_nproc"]


def parse_nproc(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``: distinct whole numbers >= 1, ascending."""
    try:
        sizes = [int(p.strip()) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"--nproc {text!r} is invalid; valid: world sizes such as 1,2,4") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--nproc {text!r} is invalid; valid: world sizes >= 1 such as 1,2,4")
    if len(set(sizes)) != len(sizes):
        raise ConfigError(f"--nproc {text!r} names a world size twice; valid: distinct sizes such as 1,2,4")
    return tuple(sorted(sizes))


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    nproc: tuple[int, ...] = (1, 2)
    """World sizes (processes per node) to run, ascending; the first is the baseline."""

    scaling: Literal["strong", "weak"] = "strong"
    """strong: the global problem stays fixed; weak: it grows with the world size (the run context's ``scaling``)."""

    repeat: int = 1
    """Runs per world size; the table shows min and median."""

    def __post_init__(self) -> None:
        if not self.nproc or min(self.nproc) < 1 or list(self.nproc) != sorted(set(self.nproc)):
            raise ConfigError(f"bench.nproc {self.nproc} is invalid; valid: distinct ascending world sizes >= 1")
        if self.scaling not in ("strong", "weak"):
            raise ConfigError(f"bench.scaling {self.scaling!r} is invalid; valid: strong, weak")
        if self.repeat < 1:
            raise ConfigError(f"bench.repeat {self.repeat} is invalid; valid: 1 or more")
