"""The model rules the engine can check, each broken rule one line naming the substep (inside each rank).

The rules are written down in :mod:`multigpu.sim.api` (5: ``moves=True``, 6: the drop slot, and
positions on the grid). These checks run on a user's substeps only (the built-in ones follow the
rules by construction and keep their speed); ``--check-split`` finds what cannot be checked here.
"""

from __future__ import annotations

import torch

from multigpu.errors import ConfigError
from multigpu.sim.api import Context, Substep

__all__ = ["check_on_grid", "check_stayed", "contribute", "raise_if_left_rows"]


def contribute(sub: Substep, ctx: Context, agents: dict[str, torch.Tensor], acc: torch.Tensor) -> None:
    """``sub.contribute`` into ``acc``; an index outside ``acc`` becomes one line naming the substep and the rule."""
    try:
        sub.contribute(ctx, agents, acc)
    except IndexError as exc:
        if sub.field == "cell":
            rule = (f"a cell field has {acc.shape[0]} slots, this rank's {acc.shape[0] - 1} cells (rows "
                    f"{ctx.lo}..{ctx.lo + ctx.rows - 1}) and a drop slot: agents outside this "
                    "rank's rows (they just moved away) go to the drop slot acc[-1]; ctx.cell(agents) does that")
        else:
            rule = f"its field has {acc.shape[0]} slots (field_size)"
        raise ConfigError(f"substep {sub.name!r}: contribute indexed outside its field ({exc}); {rule}") from exc


def check_stayed(sub: Substep, ctx: Context, chunk: dict[str, torch.Tensor], *, defer: bool) -> torch.Tensor | None:
    """ConfigError when ``sub`` (not marked moves=True) left agents of ``chunk`` outside this rank's rows.

    On the CPU at once (before the next substep looks the agents up). With ``defer`` (a GPU, where a host
    read per chunk would wait for it) the flag is returned, on the device, for :func:`raise_if_left_rows`.
    """
    lo, hi = ctx.lo, ctx.lo + ctx.rows
    y = chunk["y"]
    outside = (y < lo) | (y >= hi)
    if defer:
        return outside.any()
    if bool(outside.any()):
        first = int(torch.nonzero(outside)[0])
        raise ConfigError(f"substep {sub.name!r} moved agents but is not marked moves=True (agent id "
                          f"{int(chunk['id'][first])} is on row {int(y[first])}, outside this rank's rows "
                          f"{lo}..{hi - 1}); give the substep moves=True")
    return None


def raise_if_left_rows(flags: dict[str, torch.Tensor]) -> None:
    """The deferred side of :func:`check_stayed`: read each substep's device flag (at a flush)."""
    for name, flag in flags.items():
        if bool(flag):
            raise ConfigError(f"substep {name!r} moved agents but is not marked moves=True (agents were left "
                              "outside this rank's rows); give the substep moves=True")


def check_on_grid(sub: Substep, chunk: dict[str, torch.Tensor], grid: tuple[int, int]) -> None:
    """ConfigError when ``sub`` (a user's moving substep) put agents of ``chunk`` off the grid."""
    height, width = grid
    x, y = chunk["x"], chunk["y"]
    off = (y < 0) | (y >= height) | (x < 0) | (x >= width)
    if bool(off.any()):
        i = int(torch.nonzero(off)[0])
        raise ConfigError(f"substep {sub.name!r} moved agent id {int(chunk['id'][i])} off the grid (x {int(x[i])}, "
                          f"y {int(y[i])}; valid: 0 <= x < {width}, 0 <= y < {height}); wrap positions "
                          "(the grid is periodic: x % width, y % height)")
