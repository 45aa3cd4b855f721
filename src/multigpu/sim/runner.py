"""``run(cfg, ctx)``: build or resume the engine, step it in a :class:`multigpu.run.Run`, write the outputs
(inside each rank).

Rank 0 writes into the run directory: ``series.csv`` (the per-step aggregates),
``series.png`` (epidemic curve, price path, ...), ``summary.json`` (throughput,
comm share, imbalance, memory, bytes per agent; the run's step meter) and,
with ``--profile``, ``profile.txt``. The run writes the checkpoints (``<run_dir>/checkpoints``,
every ``checkpoint_every`` steps) and calls the callbacks.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import resource
import time
from pathlib import Path
from typing import Any

import torch

from multigpu.files import atomic_path, write_text_atomic
from multigpu.run import Run, script_context
from multigpu.runtime import collectives, context, group
from multigpu.sim import checkpoint
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine

__all__ = ["SimResult", "run"]


@dataclasses.dataclass
class SimResult:
    """What rank 0 gets back from :func:`run`."""

    series: dict[str, list]
    """step -> aggregates (one list per column, ``step`` first)."""
    summary: dict[str, Any]
    """The StepMeter summary plus simulation figures (bytes_per_agent, peak_rss_mb, phases, ...)."""
    csv_path: Path | None = None
    plot_path: Path | None = None
    agents_path: Path | None = None
    """Where ``save_agents`` wrote the final agents (ordered by id)."""
    agents: dict[str, torch.Tensor] | None = None
    """With ``run(..., return_agents=True)``: this rank's own final agents, sorted by id."""
    interrupted: int = 0
    """The signal that ended the steps early with ``checkpoint_on_interrupt`` (0: none); then every rank gets a
    result with nothing else in it, and the checkpoint of the step reached is on disk."""


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def run(cfg: SimConfig, ctx: context.RunContext | None = None, *, callbacks: list | tuple = (),
        return_agents: bool = False) -> SimResult | None:
    """Run the simulation ``cfg`` to ``cfg.steps``. Call on all ranks.

    Args:
        cfg: The simulation.
        ctx: Where it writes and what it resumes: the job's run context, or for a plain script
            ``multigpu.run.script_context(run_dir, resume="auto")`` (rank 0 writes series.csv, series.png,
            summary.json and the checkpoints into ``run_dir``; ``--profile``'s ``profile.txt`` too); None:
            nothing written, nothing resumed.
        callbacks: Objects whose ``on_step(event)`` runs on every rank after each step, before its checkpoint
            (``event.state["agents"].engine``: the engine); the config's ``callbacks`` are added to them.
        return_agents: Every rank gets a SimResult whose ``agents`` are its own final agents (sorted by
            id); the series and summary stay on rank 0 (empty elsewhere).

    Returns:
        On rank 0 a :class:`SimResult`; None on the other ranks (unless ``return_agents``).
    """
    run = Run(ctx if ctx is not None else script_context(), total=cfg.steps, checkpoint_every=cfg.checkpoint_every,
              keep_last=cfg.keep_last, mode=cfg.checkpoint_mode, checkpoint_last=False,
              callbacks=[*callbacks, *cfg.callbacks], unit="agent-steps", description=f"sim {cfg.model} ({cfg.strategy})",
              log_every=cfg.log_every, on_interrupt=cfg.checkpoint_on_interrupt)
    t0 = time.perf_counter()
    engine = SimEngine(cfg, populate=run.resume_from is None)
    if run.resume_from is not None:
        saved = checkpoint.load(engine, run)  # the run reads the files
        checkpoint.check_resize(engine, saved, run.resume_from, run.run_dir)  # on another world size: recorded
    setup_s = time.perf_counter() - t0
    run.state, run.meta = checkpoint.parts(engine), lambda: checkpoint.meta(engine)

    for _ in run.steps(timed=False):
        with run.meter.step(items=engine.state.n):
            engine.step()  # comm inside: field all-reduce / halo, agent migration
        engine.log_point()
        if engine.history["step"] and engine.series_names:
            run.meter.extras.update({n: engine.history[n][-1] for n in engine.series_names[-3:]})

    if run.interrupted:
        return _interrupted(run)
    return _finish(run, engine, setup_s, return_agents)


def _interrupted(run: Run) -> SimResult:
    """Stopped by a signal after the step the ranks agreed on: its checkpoint is on disk; say how to go on."""
    run.close()
    if group.rank() == 0 and run.checkpoints is not None:
        again = run.ctx.resume_command or f"multigpu sim --run-dir {run.run_dir} --resume auto"
        print(f"interrupted after step {run.step}: checkpoint {run.checkpoints.path_for(run.step)}; "
              f"continue with: {again}", flush=True)
    return SimResult(series={}, summary={}, interrupted=run.signal)


def _finish(run: Run, engine: SimEngine, setup_s: float, return_agents: bool) -> SimResult | None:
    """The outputs: the series, the split-independent digest, the agents file, and rank 0's files."""
    cfg, run_dir = engine.cfg, run.run_dir
    series = engine.series()
    extra = _figures(engine, setup_s, run.resume_from)
    # a digest of the final agent state, independent of the split: equal digests, equal agents
    extra["state_digest"] = checkpoint.state_digest(engine)
    agents_path = None
    if cfg.save_agents:
        from multigpu.sim import population

        agents_path = Path(cfg.save_agents)
        if not agents_path.is_absolute() and run_dir is not None:
            agents_path = run_dir / agents_path
        agents_path = population.save(engine, agents_path)
        extra["agents_file"] = str(agents_path)
    result = SimResult(series=series, summary={}, agents_path=agents_path)
    if group.rank() == 0 and run_dir is not None:  # before the summary, which names them
        result.csv_path = write_csv(series, run_dir / "series.csv")
        result.plot_path = write_plot(series, cfg, run_dir / "series.png") if cfg.plot else None
        if run.ctx.profile:
            (run_dir / "profile.txt").write_text(_profile_text(engine))
        extra["csv"], extra["plot"] = str(result.csv_path), str(result.plot_path) if result.plot_path else None
    result.summary = run.close(extra)
    own = engine.state.sorted_by_id() if return_agents else None
    if group.rank() != 0:
        return SimResult(series={}, summary={}, agents=own) if return_agents else None
    result.agents = own
    return result


def _figures(engine: SimEngine, setup_s: float, source: Path | None) -> dict[str, Any]:
    """Simulation figures gathered from every rank (a collective)."""
    mine = {"agents": engine.state.n, "peak_rss_mb": _peak_rss_mb(), "phases_s": dict(engine.timers)}
    ranks = collectives.all_gather(mine) if engine.world > 1 else [mine]
    return {
        "model": engine.cfg.model, "strategy": engine.cfg.strategy, "num_agents": engine.num_agents,
        "final_step": engine.step_index, "bytes_per_agent": engine.state.bytes_per_agent,
        "setup_s": setup_s, "resumed_from": str(source) if source else None,
        "peak_rss_mb": [r["peak_rss_mb"] for r in ranks], "agents_per_rank": [r["agents"] for r in ranks],
        "phases_s": [r["phases_s"] for r in ranks], "rebalances": engine.rebalances,
        "compile": engine.cfg.compile, "threads": torch.get_num_threads(),
    }


def write_csv(series: dict[str, list], path: Path) -> Path:
    """The aggregates as CSV (atomically)."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    names = list(series)
    writer.writerow(names)
    writer.writerows(zip(*(series[n] for n in names), strict=True))
    return write_text_atomic(path, buf.getvalue())


def write_plot(series: dict[str, list], cfg: SimConfig, path: Path) -> Path | None:
    """Epidemic curve (sir), price path (market) or agents moved (movement) as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("multigpu sim: no plot written; install matplotlib (pip install 'multigpu[report]')")
        return None
    steps = series["step"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if cfg.model == "market":
        ax.plot(steps, series["price"], color="tab:blue")
        ax.set_ylabel("price")
        ax.set_title(f"market: {cfg.agents:,} traders")
    else:
        if cfg.model == "sir":
            names, title = [n for n in series if n in ("S", "E", "I", "R")], "epidemic curve"
        elif cfg.model == "movement":
            names, title = ["moved"], "agents moved per step"
        else:  # a user's model: every aggregate
            names, title = [n for n in series if n != "step"], "aggregates"
        for name in names:
            ax.plot(steps, series[name], label=name)
        ax.set_ylabel("agents" if cfg.model in ("sir", "movement") else "value")
        ax.legend()
        ax.set_title(f"{cfg.model.rpartition(':')[2]}: {title}, {cfg.agents:,} agents")
    ax.set_xlabel("step")
    from matplotlib.text import Text

    for text in fig.findobj(Text):  # a user's model and aggregate names, shown as written (no $...$ mathtext)
        text.set_parse_math(False)
    fig.tight_layout()
    with atomic_path(path, keep_suffix=True) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path


def _profile_text(engine: SimEngine) -> str:
    """Seconds per phase on rank 0; the torch.profiler traces (``--profile``, through the run context)
    are written per rank by the step meter into ``profile/``."""
    lines = ["phase seconds on rank 0 (whole run):"]
    lines += [f"  {k:<20} {v:8.3f}" for k, v in sorted(engine.timers.items(), key=lambda kv: -kv[1])]
    return "\n".join(lines) + "\n"
