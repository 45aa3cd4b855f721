"""``multigpu sim --check-split``: does a model give the same agents on 1 and 2 ranks, with every strategy?

    multigpu sim --model mypkg.mymodel:MODEL --check-split        # exit 0: same agents; 1: names what differs

In the launcher (:func:`launch_check`), the job is launched twice through the
job contract, on 1 and on 2 ranks, with a small population (at most
:data:`AGENTS` agents, :data:`STEPS` steps, a grid of at most
:data:`GRID` cells a side for spatial models, chunks of 1024 agents so the
chunked paths run). Inside the ranks (:func:`record`), every strategy the
model allows runs in turn; rank 0 records the final agents (sorted by id) and
the aggregate series with :func:`multigpu.verify.record`. Back in the launcher
every (ranks, strategy) result is compared, bit for bit, with 1 rank's
``data`` result. What this catches: a model that breaks the rules in
:mod:`multigpu.sim.api` (random numbers from the rank or the position, float
sums across agents, reading other rows of a chunk).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

from multigpu.errors import ConfigError, MultigpuError
from multigpu.sim.config import STRATEGIES, SimConfig

__all__ = ["AGENTS", "GRID", "STEPS", "agents_on_rank0", "compare", "launch_check", "record", "small_config", "strategies"]

AGENTS = 4000
STEPS = 10
GRID = 24
SIZES = (1, 2)
"""World sizes compared (the first is the reference)."""


def strategies(cfg: SimConfig) -> tuple[str, ...]:
    """The strategies the check runs: all three for a spatial model, ``data`` otherwise."""
    from multigpu.sim.api import get_model

    return STRATEGIES if get_model(cfg.model).spatial else ("data",)


def small_config(cfg: SimConfig) -> SimConfig:
    """The check's config: a small, dense population, a few steps, small chunks, nothing written."""
    from multigpu.sim.api import get_model

    shrink = get_model(cfg.model).spatial and not cfg.population  # a population's positions need its grid
    grid = tuple(min(g, GRID) for g in cfg.grid) if shrink else cfg.grid
    return dataclasses.replace(cfg, agents=min(cfg.agents, AGENTS), steps=min(cfg.steps, STEPS), grid=grid,
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

    for strategy in strategies(cfg):
        engine = SimEngine(dataclasses.replace(cfg, strategy=strategy, check_split=False))
        series = engine.run()
        agents = agents_on_rank0(engine)
        if agents is not None:
            for name, values in agents.items():
                verify.record(f"{strategy}.agents.{name}", values)
            verify.record(f"{strategy}.series", series)


def compare(results: dict[int, dict[str, Any]], names: tuple[str, ...]) -> list[str]:
    """What differs from 1 rank's ``data`` result, one line per (ranks, strategy); empty when all agree."""
    ref_n = min(results)
    ref = {k.partition(".")[2]: v for k, v in results[ref_n].items() if k.startswith("data.")}
    problems = []
    for n, found in sorted(results.items()):
        for strategy in names:
            got = {k.partition(".")[2]: v for k, v in found.items() if k.startswith(f"{strategy}.")}
            where = f"{strategy} strategy on {n} rank(s) vs data on {ref_n}"
            problem = _difference(got, ref)
            if problem:
                problems.append(f"{where}: {problem}")
    return problems


def _difference(got: dict[str, Any], ref: dict[str, Any]) -> str | None:
    if set(got) != set(ref):
        return f"recorded {sorted(got)}, expected {sorted(ref)} (did a run fail?)"
    ids = ref.get("agents.id")
    for key in sorted(ref):
        a, b = got[key], ref[key]
        if key == "series":
            if a != b:
                column = next((c for c in b if a.get(c) != b[c]), "?")
                return f"the aggregate {column!r} differs"
            continue
        if a.shape != b.shape:
            return f"{key} has {a.shape[0]} agents, expected {b.shape[0]}"
        if not torch.equal(a, b):
            diff = (a != b) if not a.is_floating_point() else ~((a == b) | (a.isnan() & b.isnan()))
            first = int(torch.nonzero(diff)[0])
            who = f"id {int(ids[first])}" if ids is not None else f"row {first}"
            return (f"field {key.removeprefix('agents.')!r} differs for {int(diff.sum())} of {b.shape[0]} agents "
                    f"(first: {who}, {a[first].item()} vs {b[first].item()})")
    return None


def launch_check(job) -> int | None:
    """The sim workload's ``launch`` hook (in the launcher): None unless ``check_split`` is set."""
    cfg: SimConfig = job.config
    if not cfg.check_split:
        return None
    from multigpu.bench.runner import configs_for
    from multigpu.jobs.command import launch_job, prepare
    from multigpu.runtime.context import RunContext
    from multigpu.verify import load_results

    if job.plan.launch.nnodes != 1:
        raise ConfigError("--check-split runs on one machine (1 and 2 ranks); drop --nnodes")
    small = small_config(cfg)
    names = strategies(small)
    root = Path(job.plan.run.run_dir)
    results = {}
    for n, launch_cfg in configs_for(job.plan.launch, SIZES).items():
        sub = prepare(job.workload, small, launch_cfg, RunContext(), spec=job.spec)
        folder = root / f"np{n}"
        print(f"multigpu sim --check-split: {small.agents:,} agents, {small.steps} steps, {n} rank(s), "
              f"strategies {', '.join(names)} -> {folder}", file=sys.stderr, flush=True)
        launch_job(sub, RunContext(run_dir=str(folder.resolve()), verify_dir=str((folder / "verify").resolve())))
        results[n] = load_results(folder / "verify") if (folder / "verify").is_dir() else {}
    problems = compare(results, names)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise MultigpuError(f"check-split failed for model {cfg.model}: {problems[0]}{more}; see the rules "
                            "in multigpu.sim.api (random numbers by id and stream, integer fields)")
    print(f"check-split passed: model {cfg.model}, {small.agents:,} agents, {small.steps} steps: the same agents "
          f"and aggregates on {' and '.join(map(str, SIZES))} ranks with strategies {', '.join(names)}", flush=True)
    return 0
