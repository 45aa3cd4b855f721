"""Compare the results recorded at different world sizes (pure; runs in the launcher).

``compare(results, atol, rtol)`` takes ``{world_size: {name: value}}`` and
checks each name against the baseline (the smallest world size) the way
``torch.allclose`` does: ``|a - b| <= atol + rtol * |b|`` elementwise, NaN
equal to NaN. Default tolerance 0: exact. Lists, tuples and dicts are compared
item by item (a tensor inside a list is compared as a tensor); other values that
are not tensors (strings, numbers) must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Comparison", "compare", "tolerance_hint"]


@dataclass(frozen=True)
class Comparison:
    name: str
    world_size: int
    baseline: int
    passed: bool
    max_abs: float | None = None
    max_rel: float | None = None
    problem: str | None = None
    """Why the values could not be compared number by number (missing, shape, dtype, type)."""

    def describe(self) -> str:
        where = f"'{self.name}' at {self.world_size} ranks vs {self.baseline}"
        if self.problem:
            return f"{where}: {self.problem}"
        return f"{where}: max abs difference {self.max_abs:.3g}, max rel difference {self.max_rel:.3g}"


NOISE_RTOL = 1e-3
"""Relative differences up to this are float noise (another summation order), worth a tolerance hint."""


def tolerance_hint(failed: list[Comparison]) -> str | None:
    """The flags that would pass every failed comparison (``--atol X`` or ``--rtol Y``) where each is within
    float noise; None where a failure is not a numeric difference (a missing result, another shape), is
    infinite (NaN on one side) or is larger than noise (then no tolerance should hide it)."""
    if not failed or any(c.problem or c.max_abs is None or c.max_abs == float("inf") for c in failed):
        return None
    if any(c.max_rel is None or c.max_rel > NOISE_RTOL for c in failed):
        return None
    atol = _round_up(max(c.max_abs for c in failed))
    rels = [c.max_rel for c in failed]
    hint = f"--atol {atol:.2g}"
    if all(r is not None and r != float("inf") for r in rels):
        hint += f" or --rtol {_round_up(max(rels)):.2g}"
    return hint


def _round_up(value: float) -> float:
    """``value`` rounded up to two significant digits, so the flag printed really passes."""
    import math

    if value <= 0:
        return 0.0
    scale = 10 ** (math.floor(math.log10(value)) - 1)
    return math.ceil(value / scale) * scale


def _compare_values(a: Any, b: Any, atol: float, rtol: float) -> tuple[bool, float | None, float | None, str | None]:
    """(passed, max_abs, max_rel, problem) of ``a`` against the baseline ``b``; containers item by item."""
    if isinstance(b, (list, tuple, dict)) and type(a) is type(b):
        return _compare_containers(a, b, atol, rtol)
    return _compare_leaf(a, b, atol, rtol)


def _compare_containers(a, b, atol: float, rtol: float) -> tuple[bool, float | None, float | None, str | None]:
    """Every item of two lists/tuples (by position) or dicts (by key); the first problem names its place."""
    if isinstance(b, dict):
        if a.keys() != b.keys():
            return False, None, None, f"keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        pairs = [(f"[{k!r}]", a[k], b[k]) for k in b]
    else:
        if len(a) != len(b):
            return False, None, None, f"length {len(a)} vs {len(b)}"
        pairs = [(f"[{i}]", x, y) for i, (x, y) in enumerate(zip(a, b, strict=True))]
    passed, max_abs, max_rel = True, None, None
    for where, x, y in pairs:
        ok, item_abs, item_rel, problem = _compare_values(x, y, atol, rtol)
        if problem:
            return False, None, None, f"{where}{problem if problem.startswith('[') else ': ' + problem}"
        passed = passed and ok
        if item_abs is not None:
            max_abs = item_abs if max_abs is None else max(max_abs, item_abs)
            max_rel = item_rel if max_rel is None else max(max_rel, item_rel)
    return passed, max_abs, max_rel, None


def _compare_leaf(a: Any, b: Any, atol: float, rtol: float) -> tuple[bool, float | None, float | None, str | None]:
    import torch

    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        a, b = torch.tensor(float(a), dtype=torch.float64), torch.tensor(float(b), dtype=torch.float64)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        if type(a) is not type(b):
            return False, None, None, f"type {type(a).__name__} vs {type(b).__name__}"
        equal = bool(a == b)
        return equal, None, None, None if equal else f"values differ: {a!r} vs {b!r}"
    if a.shape != b.shape:
        return False, None, None, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return False, None, None, f"dtype {a.dtype} vs {b.dtype}"
    if a.numel() == 0:
        return True, 0.0, 0.0, None
    if a.dtype == torch.bool or not (a.is_floating_point() or a.is_complex()):
        a64, b64 = a.to(torch.float64), b.to(torch.float64)
    else:
        a64, b64 = a.to(torch.complex128 if a.is_complex() else torch.float64), b.to(
            torch.complex128 if b.is_complex() else torch.float64)
    both_nan = torch.isnan(a64) & torch.isnan(b64)  # complex too: NaN in either part
    diff = (a64 - b64).abs()
    diff = torch.where(both_nan, torch.zeros_like(diff), diff)
    diff = torch.nan_to_num(diff, nan=float("inf"))  # NaN on one side only: infinitely far
    ref = b64.abs()
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / ref.clamp_min(torch.finfo(torch.float64).tiny))
    passed = bool(((diff <= atol + rtol * ref) | both_nan).all())
    return passed, float(diff.max()), float(rel.max()), None


def compare(results: dict[int, dict[str, Any]], *, atol: float = 0.0, rtol: float = 0.0) -> list[Comparison]:
    """One :class:`Comparison` per (name, world size other than the baseline), in name order."""
    sizes = sorted(results)
    base = sizes[0]
    names = sorted({name for per_size in results.values() for name in per_size})
    out = []
    for name in names:
        for size in sizes[1:]:
            have_base, have = name in results[base], name in results[size]
            if not (have_base and have):
                missing = base if not have_base else size
                out.append(Comparison(name, size, base, False,
                                      problem=f"recorded at {size if missing == base else base} ranks "
                                              f"but not at {missing}"))
                continue
            passed, max_abs, max_rel, problem = _compare_values(results[size][name], results[base][name], atol, rtol)
            out.append(Comparison(name, size, base, passed, max_abs, max_rel, problem))
    return out
