"""``multigpu sim --check-split``: does a model give the same agents on 1 and 2 ranks, with every strategy?

    multigpu sim --model mypkg.mymodel:MODEL --check-split        # exit 0: same agents; 1: names what differs

In the launcher (:func:`launch_check`), the job is launched twice through the
job contract, on 1 and on 2 ranks, at the run's ``--agents`` and ``--steps`` where
they were given (at most :data:`MOST_AGENTS` and :data:`MOST_STEPS`: every agent is
recorded after every substep), else at :data:`AGENTS` agents and :data:`STEPS` steps
(:func:`check_sizes`; its first line says which), with a grid of at most
:data:`GRID` cells a side for spatial models and chunks of 1024 agents so the
chunked paths run. Inside the ranks (:func:`record`), every strategy the
model allows runs in turn; rank 0 records the final agents (sorted by id) and
the aggregate series with :func:`multigpu.verify.record`. Back in the launcher
every (ranks, strategy) result is compared, bit for bit, with 1 rank's
``data`` result. Every agent is recorded after every substep of every step,
so the failure names the first substep and field that differ (``field 'x'
differs after substep 'walk' of step 3``). What this catches: a model that
breaks the rules in :mod:`multigpu.sim.api` (random numbers from the rank or
the position, float sums across agents, reading other rows of a chunk, a
global count returned as a series).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from multigpu.errors import ConfigError, MultigpuError
from multigpu.sim.config import STRATEGIES, SimConfig

__all__ = ["AGENTS", "GRID", "MOST_AGENTS", "MOST_STEPS", "STEPS", "agents_on_rank0", "check_sizes", "compare", "launch_check", "record", "series_owners",
           "small_config", "strategies"]

AGENTS = 4000
STEPS = 10
"""The check's own sizes, for a run that gives neither ``--agents`` nor ``--steps`` (their defaults)."""
MOST_AGENTS = 100_000
MOST_STEPS = 20
"""The largest sizes the check runs at: it keeps every agent after every substep of every step, on 1 and 2 ranks."""
GRID = 24
SIZES = (1, 2)
"""World sizes compared (the first is the reference)."""


def strategies(cfg: SimConfig) -> tuple[str, ...]:
    """The strategies the check runs: all three for a spatial model, ``data`` otherwise."""
    from multigpu.sim.api import get_model

    return STRATEGIES if get_model(cfg.model).spatial else ("data",)


def check_sizes(cfg: SimConfig) -> tuple[int, int, str]:
    """(agents, steps, what they are) the check runs at: the run's where it gives them (sizes other than the
    defaults), up to :data:`MOST_AGENTS` and :data:`MOST_STEPS`; else the check's own :data:`AGENTS` and
    :data:`STEPS`. A split bug can depend on the size (a count over 3 chunks of 1024 agents on one rank and 2 + 2 on
    two), so the sizes a modeller gives are the ones checked."""
    default = SimConfig()
    given = cfg.agents != default.agents or cfg.steps != default.steps
    if not given:
        return (min(cfg.agents, AGENTS), min(cfg.steps, STEPS),
                "the check's own sizes; --agents and --steps check at yours")
    agents, steps = min(cfg.agents, MOST_AGENTS), min(cfg.steps, MOST_STEPS)
    if (agents, steps) == (cfg.agents, cfg.steps):
        return agents, steps, "your --agents and --steps"
    return agents, steps, (f"the run has {cfg.agents:,} agents and {cfg.steps} steps; the check runs at most "
                           f"{MOST_AGENTS:,} agents and {MOST_STEPS} steps, since it keeps every agent after every "
                           "substep")


def small_config(cfg: SimConfig) -> SimConfig:
    """The check's config: the sizes of :func:`check_sizes`, small chunks, nothing written."""
    from multigpu.sim.api import get_model

    shrink = get_model(cfg.model).spatial and not cfg.population  # a population's positions need its grid
    grid = tuple(min(g, GRID) for g in cfg.grid) if shrink else cfg.grid
    agents, steps, _ = check_sizes(cfg)
    return dataclasses.replace(cfg, agents=agents, steps=steps, grid=grid,
                               chunk_size=1024, rebalance_every=3, sort_every=4, checkpoint_every=0, plot=False,
                               save_agents="")


def agents_on_rank0(engine) -> dict[str, torch.Tensor] | None:
    """Every agent, sorted by id, on rank 0 (None elsewhere). gloo has no int16/uint8 collectives: widened."""
    import multigpu as mg

    parts = {}
    for name, dtype in engine.state.schema.items():
        wide = torch.float64 if dtype.is_floating_point else torch.int64
        parts[name] = mg.gather(engine.state[name].to(wide)) if engine.world > 1 else engine.state[name].to(wide)
    if engine.rank != 0:
        return None
    order = torch.argsort(parts["id"])
    return {k: v[order].to(engine.state.schema[k]) for k, v in parts.items()}


def record(cfg: SimConfig) -> None:
    """Inside every rank: run each strategy and record its agents and series for the launcher. Collective."""
    from multigpu import verify
    from multigpu.sim.engine import SimEngine

    def trace(engine, sub) -> None:  # every agent after every substep: the failure names the first that differs
        agents = agents_on_rank0(engine)
        if agents is not None:
            i = engine.substeps.index(sub)  # keys sort in the order the substeps ran
            verify.record(f"{engine.cfg.strategy}.trace.{engine.step_index + 1:04d}.{i:02d}.{sub.name}", agents)

    for strategy in strategies(cfg):
        engine = SimEngine(dataclasses.replace(cfg, strategy=strategy, check_split=False))
        engine.after_substep = trace
        series = engine.run()
        agents = agents_on_rank0(engine)
        if agents is not None:
            for name, values in agents.items():
                verify.record(f"{strategy}.agents.{name}", values)
            verify.record(f"{strategy}.series", series)


def compare(results: dict[int, dict[str, Any]], names: tuple[str, ...],
            owners: dict[str, str] | None = None) -> list[str]:
    """What differs from 1 rank's ``data`` result, one line per (ranks, strategy); empty when all agree.

    ``owners`` maps each series to the substep that returns it (named in the line).
    """
    ref_n = min(results)
    ref = {k.partition(".")[2]: v for k, v in results[ref_n].items() if k.startswith("data.")}
    problems = []
    for n, found in sorted(results.items()):
        for strategy in names:
            got = {k.partition(".")[2]: v for k, v in found.items() if k.startswith(f"{strategy}.")}
            where = f"{strategy} strategy on {n} rank(s) vs data on {ref_n}"
            problem = _first_trace_difference(got, ref) or _difference(got, ref, owners or {}, n)
            if problem:
                problems.append(f"{where}: {problem}")
    return problems


def _first_trace_difference(got: dict[str, Any], ref: dict[str, Any]) -> str | None:
    """The first (step, substep) after which some agent's field differs, named; None when all agree.

    Keys are ``trace.<step>.<index>.<substep>`` (step 1 is the first), which sort in the order they ran.
    """
    for key in sorted(k for k in ref if k.startswith("trace.")):
        if key not in got:
            return None  # a run stopped early: the final comparison says what is missing
        _, step, _, name = key.split(".", 3)
        problem = _agents_difference(got[key], ref[key])
        if problem:
            return f"{problem} after substep {name!r} of step {int(step)}"
    return None


def _agents_difference(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str | None:
    ids = ref.get("id")
    for name in ref:
        a, b = got[name], ref[name]
        if a.shape != b.shape:
            return f"{a.shape[0]} agents instead of {b.shape[0]}"
        if not torch.equal(a, b):
            diff = (a != b) if not a.is_floating_point() else ~((a == b) | (a.isnan() & b.isnan()))
            first = int(torch.nonzero(diff)[0])
            who = f"id {int(ids[first])}" if ids is not None and ids.shape == b.shape else f"row {first}"
            return (f"field {name!r} differs for {int(diff.sum())} of {b.shape[0]} agents "
                    f"(first: {who}, {a[first].item()} vs {b[first].item()})")
    return None


def _difference(got: dict[str, Any], ref: dict[str, Any], owners: dict[str, str], ranks: int) -> str | None:
    got = {k: v for k, v in got.items() if not k.startswith("trace.")}
    ref = {k: v for k, v in ref.items() if not k.startswith("trace.")}
    if set(got) != set(ref):
        return f"recorded {sorted(got)}, expected {sorted(ref)} (did a run fail?)"
    for key in sorted(ref):
        a, b = got[key], ref[key]
        if key == "series":
            a, b = _lists(a), _lists(b)
            if a != b:
                return _series_difference(a, b, owners, ranks)
            continue
    problem = _agents_difference({k.removeprefix("agents."): v for k, v in got.items() if k.startswith("agents.")},
                                 {k.removeprefix("agents."): v for k, v in ref.items() if k.startswith("agents.")})
    return f"{problem} at the end" if problem else None


def _lists(series: dict[str, Any]) -> dict[str, list]:
    """A recorded series with plain lists (``verify.record`` may store a column as a tensor)."""
    return {k: v.tolist() if isinstance(v, torch.Tensor) else list(v) for k, v in series.items()}


def _series_difference(got: dict[str, list], ref: dict[str, list], owners: dict[str, str], ranks: int) -> str:
    column = next((c for c in ref if got.get(c) != ref[c]), "?")
    of = f" (substep {owners[column]!r})" if column in owners else ""
    a, b = got.get(column) or [], ref[column]
    pairs = list(zip(a, b, strict=False))  # a run that stopped early has fewer steps
    step = next((ref["step"][i] for i, (x, y) in enumerate(pairs) if x != y), None) if "step" in ref else None
    at = f" from step {step}" if step is not None else ""
    same_zeros = len(a) == len(b) and all(x == 0 for x, y in pairs if not y)
    ratios = {x / y for x, y in pairs if y} if same_zeros else set()
    if len(ratios) == 1 and ratios != {1.0}:
        return (f"the series {column!r}{of} is {ratios.pop():g}x the 1-rank series on {ranks} ranks at every step: "
                "apply's sums are added over chunks and ranks, so a value every rank already holds (a global count "
                "from prepare) must be stored in ctx.env['series'] and named in globals=, not returned as a series")
    return f"the series {column!r}{of} differs{at}"


def series_owners(cfg: SimConfig) -> dict[str, str]:
    """Each series column -> the substep that returns it (or stores it, for ``globals``)."""
    from multigpu.sim.api import get_model, model_params

    model = get_model(cfg.model)
    params = model_params(model, cfg.params)
    steps = [model.substep(n) for n in cfg.substep_names]
    return {c: s.name for s in steps for c in [*s.series(params), *s.globals(params)]}


def launch_check(job) -> int | None:
    """The sim workload's ``launch`` hook (in the launcher): None unless ``check_split`` is set."""
    cfg: SimConfig = job.config
    if not cfg.check_split:
        return None
    from multigpu.jobs.command import launch_job, prepare
    from multigpu.launch.devices import configs_for
    from multigpu.runtime.context import RunContext
    from multigpu.verify import load_results

    if job.plan.launch.nnodes != 1:
        raise ConfigError("--check-split runs on one machine (1 and 2 ranks); drop --nnodes")
    small = small_config(cfg)
    names = strategies(small)
    root = Path(job.plan.run.run_dir)
    print(f"multigpu sim --check-split: at {small.agents:,} agents and {small.steps} steps ({check_sizes(cfg)[2]})",
          file=sys.stderr, flush=True)
    results = {}
    for n, launch_cfg in configs_for(job.plan.launch, SIZES).items():
        sub = prepare(job.workload, small, launch_cfg, RunContext(), spec=job.spec)
        folder = root / f"np{n}"
        print(f"multigpu sim --check-split: {n} rank(s), strategies {', '.join(names)} -> {folder}", file=sys.stderr,
              flush=True)
        launch_job(sub, RunContext(run_dir=str(folder.resolve()), verify_dir=str((folder / "verify").resolve())))
        results[n] = load_results(folder / "verify") if (folder / "verify").is_dir() else {}
    problems = compare(results, names, series_owners(small))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise MultigpuError(f"check-split failed for model {cfg.model}: {problems[0]}{more}; see the rules "
                            "in multigpu.sim.api (random numbers by id and stream, integer fields)")
    print(f"check-split passed: model {cfg.model}, {small.agents:,} agents, {small.steps} steps: the same agents "
          f"and aggregates on {' and '.join(map(str, SIZES))} ranks with strategies {', '.join(names)}", flush=True)
    return 0
