"""Ensembles and sweeps: many replicates of a simulation, spread over every rank (inside each rank).

    multigpu sim -f sir --replicates 100 --nproc-per-node 2
    multigpu sim -f sir --replicates 50 --sweep params.beta=0.03,0.06 --sweep params.gamma=0.1,0.2
    multigpu sim --model network_sir network.kind=random --replicates 500 --until-ci 95:0.02

Replicate r of sweep point p runs with the seed :func:`multigpu.sim.design.replicate_seed`
``(seed, p, r)``, whichever rank runs it, so every replicate's series is the
same on 1, 2 or 3 ranks (bit for bit), and so are the figures made from them.

How the work is spread (``ensemble.split``): each rank runs whole replicates
(``replicates``: a rank works alone, with no communication, as a one-process run
would; several at once in one engine where the model has a batched form, see
:mod:`multigpu.sim.batch`), or every replicate is split over all ranks, one after
another (``agents``: for populations too large for one rank); ``auto`` runs whole
replicates and splits the agents of the last ones when fewer are left than half
the ranks. Replicates go out in *waves* (each rank's share of a wave: one
replicate, or as many small ones as a batch of populations holds); rank 0
gathers each wave's series, writes one file per replicate
(:mod:`multigpu.sim.ensemble_store`) and folds it into the running mean and
variance of its point, so memory holds one wave, never the ensemble.

With ``until_ci`` the ensemble runs in *rounds* (:func:`multigpu.sim.design.next_counts`):
after each, rank 0 measures every point's widest band and the next round adds
replicates only to the points whose bands are still too wide.

A continued ensemble (``--resume``, or a worker group restarted by the launcher:
:func:`multigpu.sim.ensemble_resume.continued` decides which folder) keeps every
replicate on disk and runs the others. Each round is decided from the replicates before it alone, folded in
replicate order, which is the order an uninterrupted run folds them in; so the
rounds a killed run had finished, or begun, are decided again from the files as
that run decided them, and the continued ensemble adds exactly the replicates
the uninterrupted one would have, with the same figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from multigpu.config import from_dict, to_dict
from multigpu.errors import ConfigError
from multigpu.runtime import collectives, group, watchdog
from multigpu.sim.bands import Bands, Running
from multigpu.sim.config import SimConfig
from multigpu.sim.design import Point, design_points, next_counts, read_sweep_file, replicate_seed

if TYPE_CHECKING:
    from multigpu.runtime.context import RunContext

__all__ = ["EnsembleResult", "ensemble_points", "manifest_of", "point_configs", "run_ensemble", "series_names"]


# ----------------------------------------------------------------------------- the design
def ensemble_points(cfg: SimConfig) -> list[Point]:
    """The sweep points of ``cfg.ensemble``: the sweep file's rows times the ``--sweep`` grid (one point if none)."""
    from multigpu.sim.api import get_model

    ecfg = cfg.ensemble
    rows = read_sweep_file(ecfg.sweep_file) if ecfg.sweep_file else ()
    params = [f.name for f in dataclasses.fields(get_model(cfg.model).params)]
    return design_points(ecfg.sweep, rows, param_names=params, sim_keys=[f.name for f in dataclasses.fields(SimConfig)])


def _set(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


def point_configs(cfg: SimConfig, points: Sequence[Point]) -> list[SimConfig]:
    """One plain simulation per point: ``cfg`` without its ensemble, with the point's keys set. ConfigError
    names the point whose values the model refuses."""
    base = to_dict(cfg)
    base.pop("ensemble", None)
    out = []
    for point in points:
        data = to_dict(cfg)
        data.pop("ensemble", None)
        for key, value in point.overrides.items():
            _set(data, key, value)
        try:
            out.append(from_dict(SimConfig, data, prefix="sim"))
        except ConfigError as exc:
            raise ConfigError(f"{point.where}{exc}") from None
    return out


def series_names(cfg: SimConfig) -> list[str]:
    """The series a run of ``cfg`` reports, in order (its substeps' sums, then their global values)."""
    from multigpu.sim.api import get_model, model_params

    model = get_model(cfg.model)
    params = model_params(model, cfg.params)
    steps = [model.substep(n) for n in cfg.substep_names]
    return [n for s in steps for n in s.series(params)] + [n for s in steps for n in s.globals(params)]


def manifest_of(cfg: SimConfig, points: Sequence[Point], configs: Sequence[SimConfig]) -> dict[str, Any]:
    """What the ensemble is: the design a continued run must keep (not how many replicates, nor the bands)."""
    keep = to_dict(cfg)
    keep.pop("ensemble", None)
    for key in ("log_every", "plot", "backend", "native", "compile", "overlap", "chunk_size", "sort_every",
                "checkpoint_every", "keep_last", "callbacks"):
        keep.pop(key, None)  # how it runs, not what: the same series either way
    return {
        "model": cfg.model, "steps": cfg.steps, "seed": cfg.seed,
        "seed_rule": "replicate_seed(seed, 0 if same_seeds else point, replicate): multigpu.sim.design",
        "same_seeds": cfg.ensemble.same_seeds, "config": keep,
        "points": [{"index": p.index, "values": p.values, "series": series_names(c)}
                   for p, c in zip(points, configs, strict=True)],
    }


# ----------------------------------------------------------------------------- running replicates
def _seed_of(cfg: SimConfig):
    same = cfg.ensemble.same_seeds
    return lambda p, r: replicate_seed(cfg.seed, 0 if same else p, r)


def _run_one(cfg: SimConfig) -> dict[str, list]:
    from multigpu.sim.engine import SimEngine

    engine = SimEngine(cfg)
    return engine.run()


def _run_alone(items, configs, seeds, batch: int) -> list[tuple[int, int, dict[str, list]]]:
    """This rank's share of a wave, each replicate (or batch) run by this rank alone."""
    from multigpu.sim import batch as batching

    out = []
    with group.alone():
        by_point: dict[int, list[int]] = {}
        for p, r in items:
            by_point.setdefault(p, []).append(r)
        for p, reps in by_point.items():
            cfg = configs[p]
            if batch > 1 and len(reps) > 1 and batching.supports(cfg):
                for i in range(0, len(reps), batch):
                    some = reps[i : i + batch]
                    watchdog.heartbeat(f"ensemble point {p}, replicates {some[0]}..{some[-1]} (a batch)")
                    runs = batching.run_batch(cfg, [seeds(p, r) for r in some], device=group.current_device())
                    out += [(p, r, s) for r, s in zip(some, runs, strict=True)]
                continue
            for r in reps:
                watchdog.heartbeat(f"ensemble point {p}, replicate {r}")
                out.append((p, r, _run_one(dataclasses.replace(cfg, seed=seeds(p, r)))))
    return out


def _split_agents(items, configs, seeds) -> list[tuple[int, int, dict[str, list]]]:
    """Every rank runs every replicate of the wave together, each split over the ranks (rank 0 keeps the series)."""
    out = []
    for p, r in items:
        watchdog.heartbeat(f"ensemble point {p}, replicate {r} (split over the ranks)")
        series = _run_one(dataclasses.replace(configs[p], seed=seeds(p, r)))
        if group.rank() == 0:
            out.append((p, r, series))
    return out


def _gather(obj: Any) -> list | None:
    if group.world_size() == 1 or not group.is_initialized():
        return list(obj)
    return collectives.gather(obj, dst=0)


def _broadcast(obj: Any) -> Any:
    if group.world_size() == 1 or not group.is_initialized():
        return obj
    return collectives.broadcast_object(obj)


# ----------------------------------------------------------------------------- the ensemble
@dataclass
class Wave:
    """The ensemble's progress, what the config's ``callbacks`` read after each wave on every rank, once its
    replicates are written: ``on_step(event)`` with ``event.step`` (waves done) and ``event.state["wave"]``."""

    step: int
    """Waves done in this run."""
    replicates: int
    """Replicates done in this run."""


@dataclass
class EnsembleResult:
    """What rank 0 gets back from :func:`run_ensemble`."""

    points: list[Point]
    names: list[list[str]]
    """Each point's series names."""
    counts: list[int]
    """Replicates each point has."""
    bands: list[Bands]
    """Each point's figures (mean, sd, band, spread), made from every replicate it has."""
    summary: dict[str, Any]
    folder: Path | None = None
    tables: list[Path] = field(default_factory=list)
    plot: Path | None = None


class _Rank0:
    """Rank 0's book-keeping: the store, each point's running figures, the rounds.

    ``counts[p]``: the replicates of point p the rounds so far asked for (0 .. counts[p]-1), all folded into
    ``running[p]`` in replicate order; a round asks for more (``targets``), folds those already on disk (a
    continued ensemble), runs the rest and folds them as they come, in replicate order too."""

    def __init__(self, cfg, points, configs, names, root: Path | None, ctx, log):
        from multigpu.sim.ensemble_resume import continued
        from multigpu.sim.ensemble_store import ReplicateStore

        self.cfg, self.points, self.configs, self.names, self.log = cfg, points, configs, names, log
        # what this run continues (``ctx``: --resume, a restart): an ensemble folder, or none (a new ensemble)
        source = continued(ctx.resume, ctx.run_dir, elastic=getattr(ctx, "elastic", False),
                           say=lambda line: print(line, flush=True)) if root is not None else None
        self.store = ReplicateStore(root, manifest_of(cfg, points, configs))
        shapes = [(n, c.steps) for n, c in zip(names, configs, strict=True)]
        there = self.store.open(source, shapes, cfg.ensemble.replicates)
        self.done = {p.index: set(there.get(p.index, [])) for p in points}
        self.running = [Running() for _ in points]
        self.counts = [0] * len(points)
        self.targets: list[int] | None = None
        resumed = sum(len(v) for v in self.done.values())
        if resumed:
            log(f"ensemble: continuing with the {resumed:,} replicates already in {root}")
        self.ci = cfg.ensemble.ci
        self.level = cfg.ensemble.band_level
        watch = cfg.ensemble.ci_series
        self.columns = [[i for i, n in enumerate(ns) if not watch or n in watch] for ns in names]
        self.rounds: list[dict[str, Any]] = []

    def widest(self) -> list[float | None]:
        if self.ci is None:
            return [None] * len(self.points)
        return [self.running[p.index].bands(self.level).widest(self.ci.width, self.columns[p.index])
                for p in self.points]

    def next_items(self) -> list[tuple[int, int]]:
        """The replicates the next round runs, replicate-major (every point gets its first ones first); empty:
        the ensemble is done. A round whose replicates are all on disk already (a continued ensemble) is folded
        and logged, and the one after it decided, without running anything."""
        ecfg = self.cfg.ensemble
        while True:
            targets = next_counts(self.counts, self.widest(), self.ci, ecfg.replicates, ecfg.min_replicates)
            if targets == self.counts:
                self._fold_the_rest()
                return []
            wanted = [(p.index, r) for r in range(max(targets)) for p in self.points
                      if self.counts[p.index] <= r < targets[p.index]]
            kept = sorted(item for item in wanted if item[1] in self.done[item[0]])
            for p, r in kept:  # before any new one: an uninterrupted run folded these first too
                self.running[p].add(self.store.read(p, r))
            self.targets = targets
            self.rounds.append({"round": len(self.rounds) + 1, "replicates": len(wanted), "kept": len(kept)})
            missing = [item for item in wanted if item[1] not in self.done[item[0]]]
            if missing:
                return missing
            self.end_round(0.0)

    def end_round(self, seconds: float) -> None:
        self.counts = self.targets
        self.rounds[-1]["seconds"] = round(seconds, 3)
        _log_round(self)

    def _fold_the_rest(self) -> None:
        """Replicates on disk beyond what the rounds asked for (a continued ensemble asked for fewer): they are
        in the tables, so in the figures too."""
        for p in self.points:
            for r in sorted(self.done[p.index]):
                if r >= self.counts[p.index]:
                    self.running[p.index].add(self.store.read(p.index, r))

    def take(self, results) -> None:
        for p, r, series in sorted(results, key=lambda x: (x[0], x[1])):
            if r in self.done[p]:
                continue  # never twice
            self.store.write(p, r, series)
            values = np.array([series[n] for n in self.names[p]], dtype=np.float64).T
            self.running[p].add(values.reshape(len(series["step"]), len(self.names[p])))
            self.done[p].add(r)


def splits_agents(split: str, replicates: int, world: int) -> bool:
    """Whether a wave of ``replicates`` runs each replicate split over all ``world`` ranks: always with
    ``agents``; with ``auto`` when at most half the ranks would have a replicate of their own."""
    return world > 1 and (split == "agents" or (split == "auto" and 2 * replicates <= world))


def _wave_size(cfg: SimConfig, configs: Sequence[SimConfig]) -> tuple[int, int]:
    """(replicates per rank in a wave, replicates per batch): small replicates go out many to a rank at once (one
    gather for many), about as many as a batch of populations holds; a batch only where every point has one."""
    from multigpu.sim import batch as batching

    batch = cfg.ensemble.batch or min(batching.auto_batch(c) for c in configs)
    if not all(batching.supports(c) for c in configs):
        batch = 1
    if cfg.ensemble.wave:  # asked for: a batch never holds more than a wave
        return cfg.ensemble.wave, min(batch, cfg.ensemble.wave)
    small = min(batching.MAX_BATCH, batching.BATCH_AGENTS // max(1, max(c.agents for c in configs)))
    return max(1, small, batch), batch


def bands_title(cfg: SimConfig, replicates: int) -> str:
    """bands.png's title: the model's own name, with the spec it was given by where that says more
    (``schelling (examples.sim_schelling:MODEL)``), and the replicates."""
    from multigpu.sim.api import get_model

    name = get_model(cfg.model).name
    shown = name if name == cfg.model else f"{name} ({cfg.model})"
    return f"{shown}, {replicates:,} replicates"


def run_ensemble(cfg: SimConfig, *, run_dir: str | Path | None = None, resume: str | bool | None = None, log=None,
                 ctx: RunContext | None = None, progress: bool = False) -> EnsembleResult | None:
    """Run the ensemble ``cfg.ensemble`` of the simulation ``cfg``. Call on all ranks.

    Args:
        cfg: The simulation; its ``ensemble`` says how many replicates, which sweep, when to stop.
        run_dir: Where rank 0 writes ``ensemble/`` (see :mod:`multigpu.sim.ensemble_store`); None: the
            replicates are kept in memory and nothing is written.
        resume: Without ``ctx`` (a plain script): "auto" (True means the same) continues the ensemble in
            ``run_dir`` (its replicates are kept, the others run; none there yet: a new one), a path continues
            another run's ensemble folder in ``run_dir``, and a worker group restarted by the launcher continues
            whatever this says; the rule every workload resumes by, over ensemble folders
            (:func:`multigpu.sim.ensemble_resume.continued`). With ``ctx``, its ``resume``.
        log: Rank 0's printer (default: print).
        ctx: The run context (the job's): with it, a StepMeter times every wave (agent-steps) and
            writes ``<run_dir>/summary.json``, the figures ``multigpu bench`` reads; None: no meter.
        progress: Show the meter's progress bar (a terminal only).

    Returns:
        On rank 0 an :class:`EnsembleResult`; None on the other ranks.
    """
    from multigpu.run import Run, script_context
    from multigpu.sim.ensemble_resume import FOLDER

    t0 = time.perf_counter()
    rank, world = group.rank(), group.world_size()
    log = log or (lambda line: print(line, flush=True))
    points = ensemble_points(cfg)
    configs = point_configs(cfg, points)
    names = [series_names(c) for c in configs]
    seeds = _seed_of(cfg)
    root = Path(run_dir) / FOLDER if run_dir is not None else None
    # the run harness times every wave and calls the callbacks after it; an ensemble writes no checkpoints (its
    # replicates are its progress: rank 0 decides which folder it continues, ensemble_resume.continued) and finds
    # its length as it goes, so it ends each step itself (end_step)
    progress_now = Wave(step=0, replicates=0)
    metered = ctx is not None  # a job's: timed, with a summary.json
    ctx = (dataclasses.replace(ctx, run_dir=str(run_dir) if run_dir else None) if metered else
           script_context(run_dir, "auto" if resume is True else resume or None))
    harness = Run(dataclasses.replace(ctx, resume_from=None, resume_decided=True), {"wave": progress_now},
                  checkpoint_last=False, callbacks=cfg.callbacks, progress=progress, unit="agent-steps",
                  description=f"ensemble {cfg.model.rpartition(':')[2]}")
    meter = harness.meter if metered else None
    book = _open(cfg, points, configs, names, root, ctx, log)
    split = cfg.ensemble.split
    per_rank, batch = _wave_size(cfg, configs)
    ran = waves = 0
    agent_steps = 0
    shown = time.perf_counter()
    while True:
        items = _broadcast(book.next_items() if book is not None else None)
        if not items:
            break
        t_round = time.perf_counter()
        wave = world * per_rank
        for start in range(0, len(items), wave):
            chunk = items[start : start + wave]
            agents_split = splits_agents(split, len(chunk), world)
            mine = chunk if agents_split else chunk[rank::world]
            work = sum(configs[p].agents * configs[p].steps for p, _ in mine) // (world if agents_split else 1)
            with meter.step(items=work) if meter is not None else contextlib.nullcontext():
                if agents_split:
                    results = _split_agents(chunk, configs, seeds)
                else:
                    results = _gather(_run_alone(mine, configs, seeds, batch))
            if book is not None:
                book.take(results)
            ran += len(chunk)
            waves += 1
            agent_steps += sum(configs[p].agents * configs[p].steps for p, _ in chunk)
            progress_now.step, progress_now.replicates = waves, ran
            harness.end_step()  # callbacks: StepEvent(step=waves, state={"wave": ...}, run)
            if book is not None and time.perf_counter() - shown > 10 and start + wave < len(items):
                shown = time.perf_counter()
                log(f"ensemble: {start + len(chunk):,} of this round's {len(items):,} replicates done "
                    f"({ran / (shown - t0):,.1f} replicates/s)")
        if book is not None:
            book.end_round(time.perf_counter() - t_round)
    seconds = time.perf_counter() - t0
    if meter is not None:  # a collective: every rank
        harness.close({"model": cfg.model, "ensemble": True, "replicates_run": ran} if book is not None else None)
    if book is None:
        return None
    return _finish(cfg, book, root, ran, agent_steps, seconds, split, batch, world, seeds)


def _open(cfg, points, configs, names, root, ctx, log) -> _Rank0 | None:
    """Rank 0's book, its folder opened (new, or continued: what ``ctx`` resumes); a one-line error there (another
    design, a folder in the way) is raised on every rank, so none waits for rank 0."""
    book = error = None
    if group.rank() == 0:
        try:
            book = _Rank0(cfg, points, configs, names, root, ctx, log)
        except ConfigError as exc:
            error = str(exc)
    error = _broadcast(error)
    if error is not None:
        raise ConfigError(error)
    return book


def _log_round(book: _Rank0) -> None:
    done = book.rounds[-1]
    count, kept = done["replicates"], done["kept"]
    line = f"ensemble round {done['round']}: {count:,} replicates"
    if kept:
        line += f" ({'all' if kept == count else f'{kept:,}'} of them kept from the run being continued)"
    line += f" ({sum(book.counts):,} in all)"
    if book.ci is not None:
        widest = [w for w in book.widest() if w is not None]
        if widest:
            line += (f"; widest {book.level:.0%} band {max(widest) * book.ci.width:.2%} of its series' peak "
                     f"(asked: {book.ci.width:.2%})")
    book.log(line)


def _finish(cfg, book: _Rank0, root, ran, agent_steps, seconds, split, batch, world, seeds) -> EnsembleResult:
    from multigpu.sim.ensemble_store import plot_bands, write_tables

    ecfg = cfg.ensemble
    counts = [len(book.done[p.index]) for p in book.points]
    widest = book.widest()
    if root is not None:
        bands, tables = write_tables(root, book.points, book.names, book.store, book.level, ecfg.quantiles, seeds)
    else:
        from multigpu.sim.bands import point_bands

        bands = [point_bands((v for _, v in book.store.iter_point(p.index)), book.level, ecfg.quantiles)
                 for p in book.points]
        tables = []
    summary = {
        "model": cfg.model, "points": [
            {"index": p.index, "values": p.values, "replicates": n,
             **({"widest_band": None if w is None else w * book.ci.width,
                 "narrow_enough": w is not None and w <= 1.0} if book.ci is not None else {})}
            for p, n, w in zip(book.points, counts, widest, strict=True)],
        "replicates": sum(counts), "replicates_run": ran, "until_ci": ecfg.until_ci or None,
        "level": book.level, "quantiles": list(ecfg.quantiles), "max_replicates": ecfg.replicates,
        "narrow_enough": (all(w is not None and w <= 1.0 for w in widest) if book.ci is not None else None),
        "rounds": book.rounds, "seconds": round(seconds, 3), "world_size": world, "split": split,
        "batch": batch, "replicates_per_s": ran / seconds if seconds > 0 else None,
        "agent_steps_per_s": agent_steps / seconds if seconds > 0 else None, "same_seeds": ecfg.same_seeds,
    }
    result = EnsembleResult(points=book.points, names=book.names, counts=counts, bands=bands, summary=summary,
                            folder=root, tables=tables)
    if root is not None:
        from multigpu.monitor import write_json_atomic

        if cfg.plot:
            title = bands_title(cfg, sum(counts))
            result.plot = plot_bands(root / "bands.png", book.points, book.names, bands, book.level, title)
        summary["tables"] = [str(p) for p in tables]
        summary["plot"] = str(result.plot) if result.plot else None
        write_json_atomic(root / "summary.json", summary)
    return result


def report(result: EnsembleResult, *, most: int = 8) -> list[str]:
    """The lines ``multigpu sim`` prints about an ensemble (rank 0)."""
    s = result.summary
    lines = [f"ensemble {s['model']}: {len(result.points)} point(s), {s['replicates']:,} replicates "
             f"({s['replicates_run']:,} new) on {s['world_size']} rank(s) in {s['seconds']:.1f} s "
             f"({s['replicates_per_s'] or 0:,.1f} replicates/s, {s['agent_steps_per_s'] or 0:,.3g} agent-steps/s)"]
    if s["until_ci"]:
        ok = s["narrow_enough"]
        lines.append(f"until-ci {s['until_ci']}: " + ("every band narrow enough" if ok else
                     f"not every band narrow enough at --replicates {s['max_replicates']} (the most allowed)"))
    for point, n, b, names in list(zip(result.points, result.counts, result.bands, result.names, strict=True))[:most]:
        extra = ""
        if s["until_ci"]:
            info = s["points"][point.index]
            extra = "" if info.get("narrow_enough") else " (band still too wide)"
        finals = ", ".join(f"{name} {b.mean[-1, j]:,.4g} [{b.low[-1, j]:,.4g}, {b.high[-1, j]:,.4g}]"
                           if b.n > 1 and b.mean.shape[0] else f"{name} {b.mean[-1, j]:,.4g}" if b.mean.shape[0]
                           else name for j, name in enumerate(names))
        lines.append(f"  {point.label}: {n:,} replicates{extra}; final {finals}")
    if len(result.points) > most:
        lines.append(f"  ... and {len(result.points) - most} more points (finals.csv)")
    if result.tables:
        lines.append(f"tables: {', '.join(str(p) for p in result.tables if p.suffix == '.csv')}")
    if result.plot:
        lines.append(f"plot: {result.plot}")
    return lines
