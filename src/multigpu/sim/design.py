"""What an ensemble runs: sweep points, replicate seeds, rounds (pure; read on both sides of the launch).

    multigpu sim -f sir --replicates 50 --sweep beta=0.02,0.05 --sweep gamma=0.1,0.2   # 4 points x 50
    multigpu sim -f sir --replicates 200 --until-ci 95:0.02 --sweep-file design.csv

A *point* is one setting of the swept keys (``--sweep`` lists make a grid, a
sweep file adds its rows); a *replicate* is one run of a point with its own
seed. Replicate r of point p runs with :func:`replicate_seed` ``(seed, p, r)``:
a hash of the run's seed and (p, r) only, never of the rank that runs it, so
the per-replicate series are the same on any number of ranks. With
``ensemble.same_seeds`` the seed ignores p (common random numbers: replicate r
of every point shares its random numbers, and the differences between points
are the parameters', not the noise's).

A swept name is a model parameter (``beta`` or ``params.beta``) or another
simulation key (``agents``, ``network.contacts``). Values: a list ``0.1,0.2``,
or ``start:stop:count`` (evenly spaced, both ends included). A sweep file is a
CSV (a header of names, one point per row) or a YAML/JSON list of mappings.

Rounds (:func:`next_counts`): without ``until_ci`` one round runs every
replicate; with it, a first round of ``min_replicates`` per point, then rounds
that add replicates only where some band is still wider than asked, each round
sized from the widest band (the width of a mean's band falls as
1/sqrt(replicates)), up to ``replicates``. Every decision is a function of the
results, never of the rank count, so 1, 2 and 3 ranks run the same replicates.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError

__all__ = ["CI", "MAX_POINTS", "MAX_REPLICATES", "EnsembleConfig", "Point", "check_points", "check_replicates",
           "design_points", "next_counts", "parse_sweep", "parse_until_ci", "replicate_seed", "sweep_values"]

_M64 = (1 << 64) - 1
_SEED_TAG = 0x656E73656D626C65  # "ensemble": replicate seeds apart from the step keys of sim.rng
SPLITS = ("auto", "replicates", "agents")
NOT_SWEPT = ("seed", "ensemble", "check_split", "calibrate", "differentiable", "save_agents", "callbacks",
             "checkpoint_every", "keep_last", "plot", "log_every", "backend", "model")
"""Keys a sweep cannot vary: the seed is the replicates', the rest are the run's, not the model's."""
MAX_POINTS = 10_000
"""The most sweep points one ensemble has: each is a model config made and checked in the launcher (about 2 ms
each: 20 s at this many) and a folder of replicates. Counted before any point is made."""
MAX_REPLICATES = 1_000_000
"""The most replicates one ensemble runs in all (points x replicates): each is a file of its own, and a round lists
the ones it runs in rank 0's memory. Counted before any is listed."""


def check_points(count: int, why: str) -> None:
    """Refuse (one-line ConfigError) a design of ``count`` sweep points past :data:`MAX_POINTS`; ``why`` says what
    makes them."""
    if count > MAX_POINTS:
        raise ConfigError(f"{why}; valid: at most {MAX_POINTS:,} sweep points in one ensemble (fewer values, a "
                          "coarser start:stop:count, or several runs)")


def check_replicates(points: int, replicates: int) -> None:
    """Refuse (one-line ConfigError) ``points`` x ``replicates`` past :data:`MAX_REPLICATES`."""
    if points * replicates > MAX_REPLICATES:
        what = (f"sim.ensemble.replicates={replicates} is more than one ensemble runs:" if points == 1 else
                f"{points:,} points x {replicates:,} replicates = {points * replicates:,} replicates;")
        raise ConfigError(f"{what} valid: at most {MAX_REPLICATES:,} replicates in all (points x replicates: each "
                          "is a file of its own); fewer, or several runs")


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def replicate_seed(seed: int, point: int, replicate: int) -> int:
    """The seed of replicate ``replicate`` of point ``point`` (< 2**62): a hash of the three, nothing else."""
    z = _splitmix64(_splitmix64(_splitmix64(seed ^ _SEED_TAG) ^ point) ^ replicate)
    return z >> 2


@dataclass(frozen=True)
class CI:
    """A stopping rule: every band at ``level`` narrower than ``width`` times its series' peak."""

    level: float
    """Confidence level of the bands, in (0, 1) (0.95)."""
    width: float
    """Largest full width (high - low) of a band, as a share of the largest absolute mean of its series."""

    def __str__(self) -> str:
        return f"{self.level * 100:g}:{self.width:g}"


def parse_until_ci(text: str) -> CI | None:
    """``"95:0.01"`` -> CI(0.95, 0.01); ``""`` -> None. ConfigError on anything else."""
    if not text:
        return None
    level, sep, width = str(text).partition(":")
    try:
        lv, w = float(level.rstrip("%")), float(width)
    except ValueError:
        lv = w = math.nan
    if not sep or not 50 <= lv < 100 or not 0 < w < 1:
        raise ConfigError(f"sim.ensemble.until_ci {text!r} is invalid; valid: LEVEL:WIDTH, a confidence level in "
                          "[50, 100) and the widest band as a share of its series' peak, in (0, 1): e.g. 95:0.01 "
                          "(every 95% band narrower than 1% of its series' peak)")
    return CI(lv / 100, w)


def _value(raw: Any) -> Any:
    import yaml

    if not isinstance(raw, str):
        return raw
    try:
        return yaml.safe_load(raw) if raw.strip() else raw
    except yaml.YAMLError:
        return raw


def sweep_values(name: str, text: Any) -> list[Any]:
    """The values of one swept name: a list, ``"0.1,0.2"`` or ``"start:stop:count"`` (evenly spaced)."""
    if isinstance(text, (list, tuple)):
        values = [_value(v) for v in text]
    else:
        raw = str(text).strip()
        parts = raw.split(":")
        if len(parts) == 3 and "," not in raw:
            try:
                lo, hi, n = float(parts[0]), float(parts[1]), int(parts[2])
            except ValueError:
                n = 0
            if n < 2:
                raise ConfigError(f"--sweep {name}={raw}: valid: start:stop:count with numbers and a count >= 2 "
                                  "(e.g. 0.01:0.1:10), or a list v1,v2,...")
            check_points(n, f"--sweep {name}={raw} makes {n:,} points")
            values = [float(f"{lo + (hi - lo) * i / (n - 1):.12g}") for i in range(n)]  # 0.3, not 0.30000000000000004
        else:
            check_points(raw.count(",") + 1, f"--sweep {name}= lists {raw.count(',') + 1:,} values")
            values = [_value(v) for v in raw.split(",") if v.strip()]
    check_points(len(values), f"--sweep {name} lists {len(values):,} values")
    if not values:
        raise ConfigError(f"--sweep {name}= has no values; valid: {name}=v1,v2,... or {name}=start:stop:count")
    return values


def parse_sweep(items: Any) -> dict[str, list[Any]]:
    """``["beta=0.1,0.2", "gamma=0.1"]`` or ``{"beta": [0.1, 0.2]}`` -> ``{"beta": [0.1, 0.2], ...}``, in order."""
    if not items:
        return {}
    if isinstance(items, Mapping):
        pairs = [(str(k), v) for k, v in items.items()]
    else:
        if isinstance(items, str):
            items = [items]
        pairs = []
        for item in items:
            name, sep, values = str(item).partition("=")
            if not sep or not name.strip():
                raise ConfigError(f"--sweep {item!r} is invalid; valid: NAME=v1,v2,... (a parameter such as beta, "
                                  "or a key such as agents), or NAME=start:stop:count")
            pairs.append((name.strip(), values))
    out: dict[str, list[Any]] = {}
    for name, values in pairs:
        if name in out:
            raise ConfigError(f"--sweep {name} is given twice; give each name once (its values as one list)")
        out[name] = sweep_values(name, values)
    sizes = [len(v) for v in out.values()]
    if len(sizes) > 1:
        check_points(math.prod(sizes), f"--sweep makes {math.prod(sizes):,} points ({' x '.join(f'{n:,}' for n in sizes)})")
    return out


def read_sweep_file(path: str | Path) -> list[dict[str, Any]]:
    """The points of a sweep file: a CSV (header of names, a row per point) or a YAML/JSON list of mappings."""
    path = Path(path)
    where = f"sim.ensemble.sweep_file '{path}'"
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where} cannot be read: {exc.strerror or exc}") from None
    if path.suffix.lower() == ".csv":
        rows = [{k.strip(): _value(v) for k, v in row.items()} for row in csv.DictReader(text.splitlines())]
        if rows and any(None in r or any(v is None or v == "" for v in r.values()) for r in rows):
            raise ConfigError(f"{where}: every row needs one value per column of the header")
    else:
        import yaml

        try:
            rows = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where} is not valid YAML/JSON: {str(exc).splitlines()[0]}") from None
        if not isinstance(rows, list) or not all(isinstance(r, Mapping) and r for r in rows):
            raise ConfigError(f"{where}: valid: a CSV with a header, or a YAML/JSON list of mappings "
                              "(one point each, e.g. [{beta: 0.1, gamma: 0.2}, ...])")
        rows = [{str(k): v for k, v in r.items()} for r in rows]
    if not rows:
        raise ConfigError(f"{where} holds no points; valid: a CSV with a header and a row per point")
    return rows


@dataclass(frozen=True)
class Point:
    """One sweep point: its index and the keys it sets (dotted simulation keys -> values)."""

    index: int
    values: dict[str, Any]
    """As the user named them (``beta``, ``agents``): what tables and plots show."""
    overrides: dict[str, Any]
    """The same as dotted simulation keys (``params.beta``)."""

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.values.items()) \
            or "all replicates"

    @property
    def where(self) -> str:
        """What an error message about this point starts with ("" for the only point of a plain ensemble)."""
        return f"--sweep point {self.index} ({self.label}): " if self.values else ""


def _key(name: str, param_names: Sequence[str], sim_keys: Sequence[str]) -> str:
    """The dotted simulation key a swept ``name`` sets (a bare parameter name is ``params.<name>``)."""
    top = name.split(".")[0]
    if top in NOT_SWEPT:
        raise ConfigError(f"--sweep {name}: {top} cannot be swept (the replicates set their own seeds; the others "
                          "are the run's settings); valid: a model parameter "
                          f"({', '.join(param_names) or 'none'}) or a key such as agents")
    if name in param_names:
        return f"params.{name}"
    if top == "params" or top in sim_keys:
        return name
    raise ConfigError(f"--sweep {name}: not a parameter of the model nor a simulation key; valid: "
                      f"{', '.join(param_names) or '(no parameters)'}, or keys such as agents, network.contacts")


def design_points(sweep: Mapping[str, list[Any]], rows: Sequence[Mapping[str, Any]] = (), *,
                  param_names: Sequence[str] = (), sim_keys: Sequence[str] = ()) -> list[Point]:
    """Every point: the sweep file's rows (or one empty row) times the grid of ``sweep``, in that order."""
    names = list(sweep)
    clash = sorted(set(names) & {k for r in rows for k in r})
    if clash:
        raise ConfigError(f"--sweep {clash[0]} is also a column of the sweep file; give it in one place")
    grid = math.prod(len(sweep[n]) for n in names)
    check_points(max(1, len(rows)) * grid, f"the sweep file's {len(rows):,} rows x the --sweep grid's {grid:,} points "
                                            f"make {max(1, len(rows)) * grid:,} points")
    points = []
    for row in rows or [{}]:
        for combo in itertools.product(*(sweep[n] for n in names)):
            values = {**row, **dict(zip(names, combo, strict=True))}
            overrides = {_key(k, param_names, sim_keys): v for k, v in values.items()}
            points.append(Point(len(points), values, overrides))
    return points


def next_counts(done: Sequence[int], widest: Sequence[float | None], ci: CI | None, most: int,
                first: int) -> list[int]:
    """How many replicates each point should have after the next round (its count now: no more).

    ``done``: replicates each point has; ``widest``: per point, its widest band over the width asked
    (> 1: too wide; None: not known yet, fewer than 2 replicates). Without ``ci``: ``most`` each.
    """
    if ci is None:
        return [max(n, most) for n in done]
    out = []
    for n, ratio in zip(done, widest, strict=True):
        if n == 0 or ratio is None:
            want = max(n, min(most, max(first, 2)))
        elif ratio <= 1.0:
            want = n
        else:  # width ~ 1/sqrt(n): n * ratio**2 replicates would do; a tenth more for the t quantile and noise
            want = min(most, max(n + 1, min(4 * n, math.ceil(n * ratio * ratio * 1.1))))
        out.append(want)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class EnsembleConfig:
    replicates: int = 1
    """Replicates per sweep point (with ``until_ci``: the most per point). More than 1, a sweep or a sweep file
    make the run an ensemble."""
    sweep: Any = field(default_factory=dict)
    """Swept names and their values: ``{beta: [0.02, 0.05]}``, or ``--sweep beta=0.02,0.05`` (repeatable:
    several make a grid). A name is a model parameter or a simulation key (agents, network.contacts)."""
    sweep_file: str = ""
    """More points: a CSV (header of names, a row per point) or YAML/JSON list of mappings; times the grid."""
    until_ci: str = ""
    """``LEVEL:WIDTH``: add replicates in rounds until every band at LEVEL% is narrower than WIDTH times its
    series' peak (95:0.01), up to ``replicates``. Empty: run ``replicates`` per point."""
    ci_series: tuple[str, ...] = ()
    """The series ``until_ci`` watches (default: every series)."""
    min_replicates: int = 10
    """``until_ci``: replicates per point in the first round."""
    level: float = 0.95
    """Confidence level of the bands written without ``until_ci`` (with it: its LEVEL)."""
    quantiles: tuple[float, ...] = (0.05, 0.95)
    """The spread of the replicates written beside the mean's band (q_low, q_high), and their median."""
    same_seeds: bool = False
    """Replicate r has the same seed at every point (common random numbers): the differences between points are
    then the parameters', not the noise's."""
    split: str = "auto"
    """replicates (each rank runs whole replicates, one at a time or a batch at once), agents (each replicate is
    split over every rank, one after another) or auto (whole replicates; split the agents when fewer
    replicates are left than ranks)."""
    batch: int = 0
    """Replicates one rank runs at once in one engine, where the model has a batched form (network_sir);
    0: chosen (a batch for small populations, one engine per replicate for large ones); 1: never batched."""
    wave: int = 0
    """Replicates each rank runs per wave: what is gathered and written at once, and the most a kill can lose
    (their files are written when the wave ends); 0: chosen (as many as a batch of populations holds)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "sweep", parse_sweep(self.sweep))
        if self.replicates > MAX_REPLICATES:
            check_replicates(1, self.replicates)
        if self.replicates < 1 or self.min_replicates < 2 or self.batch < 0 or self.wave < 0:
            raise ConfigError(f"sim.ensemble: replicates={self.replicates}, min_replicates={self.min_replicates}, "
                              f"batch={self.batch}, wave={self.wave}; valid: replicates >= 1, min_replicates >= 2, "
                              "batch >= 0, wave >= 0")
        if not 0.5 <= self.level < 1:
            raise ConfigError(f"sim.ensemble.level={self.level} is invalid; valid: 0.5 <= level < 1 (0.95)")
        if len(self.quantiles) != 2 or not 0 <= self.quantiles[0] < self.quantiles[1] <= 1:
            raise ConfigError(f"sim.ensemble.quantiles={list(self.quantiles)} is invalid; valid: [low, high] with "
                              "0 <= low < high <= 1 (e.g. [0.05, 0.95])")
        if self.split not in SPLITS:
            raise ConfigError(f"sim.ensemble.split {self.split!r} is invalid; valid: {', '.join(SPLITS)}")
        ci = parse_until_ci(self.until_ci)
        if ci is not None and self.replicates < 2:
            raise ConfigError(f"--until-ci {self.until_ci} needs --replicates N, the most replicates per point to "
                              "run (N >= 2; e.g. --replicates 500)")

    @property
    def active(self) -> bool:
        """Whether the run is an ensemble (several replicates, or a sweep)."""
        return self.replicates > 1 or bool(self.sweep) or bool(self.sweep_file)

    @property
    def ci(self) -> CI | None:
        return parse_until_ci(self.until_ci)

    @property
    def band_level(self) -> float:
        ci = self.ci
        return ci.level if ci is not None else self.level
