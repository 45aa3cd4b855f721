"""How figures are written for people: bytes, rates, and a figure that was not measured (pure; both sides).

One place for the units every message, table and report uses, so that ``1.5 GiB`` or ``12,345`` items/s read the
same in the launcher's lines, ``multigpu bench``'s table, the dry run and the HTML report.
"""

from __future__ import annotations

__all__ = ["NOT_MEASURED", "fmt_rate", "format_bytes", "shown"]

NOT_MEASURED = "—"
"""How a figure that was not measured is shown (comm share and imbalance under DDP's NCCL all-reduce, or of a script
measured by wall clock): never as 0."""


def format_bytes(n: float) -> str:
    """``1.5 GiB``: binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def shown(value: float | None, spec: str) -> str:
    """``format(value, spec)``, or :data:`NOT_MEASURED` for None."""
    return NOT_MEASURED if value is None else format(value, spec)


def fmt_rate(value: float | None) -> str:
    """Items/s: whole numbers from 100 up, else three significant digits (a wall-timed run is 0.05 runs/s)."""
    if value is None:
        return NOT_MEASURED
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"
