"""The mean of an ensemble's series and its confidence band, per sweep point (pure; rank 0 of an ensemble).

Per point, series and step: the mean over replicates, the standard deviation,
the band of the mean at ``level`` (Student's t: ``mean ± t(level, n-1) · sd / √n``)
and the spread of the replicates themselves (the ``quantiles`` and the median).
The band of the mean narrows as 1/√n with more replicates (what ``until_ci``
waits for); the spread does not (it is the model's own variability).

:class:`Running` folds replicates in one at a time (Welford's update, float64),
so no point ever holds all its replicates; replicates folded in the same order
give the same figures bit for bit. :func:`point_bands` computes every figure of a
point from its replicates at once (the final tables, quantiles included).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Bands", "Running", "point_bands", "t_quantile"]


# ----------------------------------------------------------------------------- Student's t
def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=4096)
def t_quantile(q: float, df: int) -> float:
    """The ``q`` quantile of Student's t with ``df`` degrees of freedom (q in (0.5, 1); to ~1e-12)."""
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _t_cdf(mid, df) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------- figures
@dataclass
class Bands:
    """One point's figures: arrays [steps, series] (float64); ``q_*`` and ``median`` only from :func:`point_bands`."""

    n: int
    mean: np.ndarray
    sd: np.ndarray
    low: np.ndarray
    """Lower end of the band of the mean."""
    high: np.ndarray
    q_low: np.ndarray | None = None
    median: np.ndarray | None = None
    q_high: np.ndarray | None = None

    def widest(self, width: float, columns: Sequence[int] | None = None) -> float | None:
        """The widest band of ``columns`` (default all) over ``width`` times its series' peak absolute mean:
        > 1 means too wide. None with fewer than 2 replicates (no band yet)."""
        if self.n < 2:
            return None
        cols = list(range(self.mean.shape[1])) if columns is None else list(columns)
        worst = 0.0
        for c in cols:
            span = float(np.max(self.high[:, c] - self.low[:, c])) if self.mean.shape[0] else 0.0
            peak = float(np.max(np.abs(self.mean[:, c]))) if self.mean.shape[0] else 0.0
            if span > 0:
                worst = max(worst, span / (width * peak) if peak > 0 else math.inf)
        return worst


def _band(n: int, mean: np.ndarray, var: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    sd = np.sqrt(var)
    if n < 2:
        nan = np.full_like(mean, np.nan)
        return sd, nan, nan
    half = t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return sd, mean - half, mean + half


class Running:
    """Welford's running mean and variance of one point's replicates ([steps, series] each)."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: np.ndarray | None = None
        self.m2: np.ndarray | None = None

    def add(self, values: np.ndarray) -> None:
        x = np.asarray(values, dtype=np.float64)
        if self.mean is None:
            self.mean, self.m2 = np.zeros_like(x), np.zeros_like(x)
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    def bands(self, level: float) -> Bands:
        if self.mean is None:
            return Bands(0, np.zeros((0, 0)), np.zeros((0, 0)), np.zeros((0, 0)), np.zeros((0, 0)))
        var = self.m2 / (self.n - 1) if self.n > 1 else np.zeros_like(self.m2)
        sd, low, high = _band(self.n, self.mean, var, level)
        return Bands(self.n, self.mean.copy(), sd, low, high)


def point_bands(replicates: Iterable[np.ndarray], level: float, quantiles: tuple[float, float]) -> Bands:
    """Every figure of one point from its replicates (each [steps, series]), in the order given: the mean and
    standard deviation from all of them at once (a mean of integers as exact as float64 allows, not Welford's)."""
    stack = [np.asarray(values, dtype=np.float64) for values in replicates]
    if not stack:
        return Running().bands(level)
    data = np.stack(stack)
    n = data.shape[0]
    mean = data.mean(0)
    var = data.var(0, ddof=1) if n > 1 else np.zeros_like(mean)
    sd, low, high = _band(n, mean, var, level)
    q_low, median, q_high = np.quantile(data, [quantiles[0], 0.5, quantiles[1]], axis=0)
    return Bands(n, mean, sd, low, high, q_low, median, q_high)
