"""The ``sim`` workload: an agent-based simulation split over ranks (``check`` in the launcher, ``main`` in each rank).

    multigpu sim -f sir --agents 10_000_000 --steps 100 --nproc-per-node 2 --strategy spatial
    multigpu sim -f market params.impact=0.2 --run-dir runs/market
    multigpu sim -f sir --checkpoint-every 10 --resume auto --run-dir runs/sir
    multigpu bench --nproc 1,2 sim agents=2000000
    multigpu sim --model examples.sim_schelling:MODEL --check-split   # your model: same agents on 1 and 2 ranks?
    multigpu sim -f sir params.beta=0.02 --calibrate runs/target/series.csv   # learn beta by gradient descent
    multigpu sim -f sir --replicates 100 --sweep params.beta=0.03,0.06 --nproc-per-node 2   # an ensemble

Rank 0 prints the figures and the output paths (``series.csv``, ``series.png``,
``summary.json`` in the run directory); see :func:`multigpu.sim.run`.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from multigpu.argtypes import non_negative_int, positive_int
from multigpu.errors import ConfigError
from multigpu.jobs.workload import Flag, JobPlan, Workload
from multigpu.runtime.context import RunContext
from multigpu.sim.config import SimConfig
from multigpu.sim.ensemble_resume import FOLDER, VALID, holds_ensemble

__all__ = ["WORKLOAD", "check", "main"]


def check(cfg: SimConfig, plan: JobPlan) -> SimConfig:
    _check_resume(cfg, plan.ctx.resume, plan.ctx.run_dir)
    cfg.check_world(plan.world_size)
    cfg = _check_files(cfg, plan)
    if cfg.ensemble.active:
        return _check_ensemble(cfg, plan)
    _check_fits(cfg, plan)
    return cfg


def _check_ensemble(cfg: SimConfig, plan: JobPlan) -> SimConfig:
    """Every sweep point is a valid simulation that fits (a whole replicate on one rank, unless the agents are
    split); a continued one keeps its design and has whole files (:func:`_check_continued`)."""
    from multigpu.sim.design import check_replicates
    from multigpu.sim.ensemble import ensemble_points, point_configs

    ecfg = cfg.ensemble
    if ecfg.sweep_file:
        ecfg = dataclasses.replace(ecfg, sweep_file=str(Path(ecfg.sweep_file).resolve()))
        cfg = dataclasses.replace(cfg, ensemble=ecfg)
    points = ensemble_points(cfg)
    check_replicates(len(points), ecfg.replicates)
    configs = point_configs(cfg, points)
    whole = ecfg.split != "agents"
    for point, pcfg in zip(points, configs, strict=True):
        try:
            pcfg.check_world(plan.world_size)
            pcfg = _check_files(pcfg, plan)
            _check_fits(pcfg, dataclasses.replace(plan, world_size=1) if whole else plan)
        except ConfigError as exc:
            more = ("; or ensemble.split=agents (each replicate split over every rank)"
                    if whole and "does not fit" in str(exc) else "")
            raise ConfigError(f"{point.where}{exc}{more}") from None
    if plan.ctx.resume:
        _check_continued(cfg, plan, points, configs)
    return cfg


def _check_continued(cfg: SimConfig, plan: JobPlan, points, configs) -> None:
    """A resumed ensemble, before anything starts: the folder it continues (``--resume PATH``, or the run's own)
    is of this design and every replicate file in it whole, and none is beyond the replicates asked; a run
    folder whose ensemble/ folder lost its manifest is not started over. One line each (rank 0 checks the
    same where it opens the folder: a restarted worker group, a plain script)."""
    from multigpu.sim.ensemble import manifest_of, series_names
    from multigpu.sim.ensemble_resume import check_design, named, own_folder
    from multigpu.sim.ensemble_store import check_folder, check_no_orphans

    resume, run_dir = plan.ctx.resume, plan.ctx.run_dir
    target = own_folder(run_dir) if resume == "auto" else named(resume)
    if target is None:
        if resume == "auto" and run_dir:
            check_no_orphans(Path(run_dir) / FOLDER)
        return
    check_design(target, manifest_of(cfg, points, configs))
    check_folder(target, [(series_names(c), c.steps) for c in configs], cfg.ensemble.replicates)


def _check_resume(cfg: SimConfig, resume: str | None, run_dir: str | None) -> None:
    """``--resume``: an ensemble continues an ensemble folder, a simulation a checkpoint (the files of ``PATH``
    checked: sizes and SHA-256 only, the launcher unpickles nothing); one line when it names neither, or the
    other kind (an ensemble writes no checkpoints)."""
    if resume is None:
        return
    from multigpu.checkpoint import CorruptCheckpointError, check_resume_path, is_checkpoint
    from multigpu.checkpoint.store import old_layout
    from multigpu.sim.ensemble_resume import named

    path = Path(resume)
    if resume != "auto" and named(path) is None:
        if not path.exists():
            raise ConfigError(f"--resume {resume}: no such file or folder (it is not a checkpoint folder nor a run's "
                              f"{FOLDER}/ folder); valid: {VALID}")
        if not is_checkpoint(path) and old_layout(path.parent if path.is_file() else path) is None:
            raise ConfigError(f"--resume {resume}: not a checkpoint folder nor a run's {FOLDER}/ folder (it has no "
                              f"manifest.json, so nothing in it has a checksum and it is not loaded); valid: {VALID}")
        try:  # sizes and SHA-256 only: the launcher unpickles nothing
            check_resume_path(resume)
        except CorruptCheckpointError as exc:
            raise ConfigError(f"--resume {resume}: {exc.reason}; valid: auto, a checkpoints/step_* folder written "
                              "by multigpu sim, or an ensemble folder") from None
    _not_a_checkpoint(cfg.ensemble.active, resume, run_dir)


def _not_a_checkpoint(ensemble: bool, resume: str, run_dir: str | None) -> None:
    """An ensemble continues an ensemble folder, never a checkpoint; a simulation the reverse: one line each."""
    from multigpu.checkpoint import is_checkpoint
    from multigpu.checkpoint.resume import planned
    from multigpu.sim.ensemble_resume import named, own_folder

    target = (planned(resume, run_dir) or own_folder(run_dir)) if resume == "auto" else (named(resume) or Path(resume))
    if target is None:
        return
    if ensemble and is_checkpoint(target) and named(target) is None:
        raise ConfigError(f"--resume: {target} is a checkpoint, and this sim config continues a run's {FOLDER}/ folder "
                          f"(it writes no checkpoints); valid: a run's {FOLDER}/ folder, or a new --run-dir without "
                          "--resume")
    if not ensemble and named(target) is not None:
        raise ConfigError(f"--resume: {target} is the {FOLDER}/ folder of a sim run, and this sim config does not "
                          "continue one; valid: the settings that made it, or a new --run-dir without --resume")


def _check_files(cfg: SimConfig, plan: JobPlan) -> SimConfig:
    """Population and agent-file paths made absolute (the ranks may start elsewhere); the population's
    columns checked against the model and its row count made the number of agents. Headers only."""
    from pathlib import Path

    from multigpu.sim import population
    from multigpu.sim.api import get_model

    if cfg.save_agents:
        target = Path(cfg.save_agents)
        if target.suffix in (".csv", ".npy"):
            raise ConfigError(f"sim.save_agents {cfg.save_agents!r}: {target.suffix} is not written; valid: "
                              "a .npz or .parquet file, or a folder (one .npy per field)")
        if target.suffix == ".parquet":
            population.import_pyarrow()  # an install hint now, not after the run
        if not target.is_absolute() and plan.ctx.run_dir:
            target = Path(plan.ctx.run_dir) / target  # where the ranks will write it (sim.runner)
        population.check_target(target, get_model(cfg.model).fields)  # never replace what we did not write
    if cfg.calibrate.target:
        from multigpu.sim.calibration import read_target, target_columns

        target = Path(cfg.calibrate.target).resolve()
        read_target(target, cfg.steps, cfg.calibrate.columns, target_columns(cfg))  # one line now if it cannot serve
        cfg = dataclasses.replace(cfg, calibrate=dataclasses.replace(cfg.calibrate, target=str(target)))
    if cfg.network.kind == "file":
        edges = Path(cfg.network.path).resolve()
        try:
            heads = population.read_headers(edges)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("sim.population", "sim.network.path")) from None
        if set(heads) != {"src", "dst"}:
            raise ConfigError(f"sim.network.path {cfg.network.path!r} has columns {sorted(heads)}; valid: src, dst")
        for name, (_, dtype) in heads.items():  # CSV (no dtype here) is refused by the ranks, naming the value
            if dtype is not None and dtype.kind not in "iu":  # 1.0 too: ids are written as integers, never rounded
                raise ConfigError(f"sim.network.path {cfg.network.path!r}: column {name!r} holds {dtype} values; "
                                  "valid: agent ids as integers (an integer dtype such as int32 or int64)")
        cfg = dataclasses.replace(cfg, network=dataclasses.replace(cfg.network, path=str(edges)))
    if not cfg.population:
        return cfg
    from multigpu.sim.api import model_params

    path = Path(cfg.population).resolve()
    model = get_model(cfg.model)
    rows, _ = population.columns(path, model.fields)
    population.check_values(path, model, model_params(model, cfg.params))  # e.g. SIR's state 1 (E) without seir
    return dataclasses.replace(cfg, population=str(path), agents=rows)


def _check_fits(cfg: SimConfig, plan: JobPlan) -> None:
    """The agents (times the weak-scaling factor) have ids, and each rank's share fits its memory."""
    from multigpu.sim.config import MAX_AGENTS, WORKING_BYTES_FACTOR
    from multigpu.units import format_bytes

    scale = plan.ctx.problem_scale(plan.world_size)
    agents = cfg.agents * scale
    weak = f" × {scale} ranks (weak scaling) = {agents:_}" if scale > 1 else ""
    if agents > MAX_AGENTS:
        raise ConfigError(f"sim.agents={cfg.agents:_}{weak} is more than the {MAX_AGENTS:_} agent ids (int32) allow; "
                          f"valid: sim.agents <= {MAX_AGENTS // scale:_}")
    types = ["cpu"] if cfg.backend == "cpu" else plan.device_types
    limits = [(m, t) for t in types if (m := plan.devices.memory_per_rank(t)) is not None]
    if not limits:
        return
    memory, device = min(limits)
    need = cfg.bytes_per_rank(agents, plan.world_size)
    if need <= memory:
        return
    per_agent = cfg.bytes_per_agent * WORKING_BYTES_FACTOR
    cells = cfg.bytes_per_rank(0, plan.world_size)
    fits = max(memory - cells, 0) // per_agent * plan.world_size // scale
    where = plan.devices.memory_words(device)
    raise ConfigError(
        f"sim.agents={cfg.agents:_}{weak} does not fit: {-(-agents // plan.world_size):,} agents per rank need about "
        f"{format_bytes(need)} ({cfg.bytes_per_agent} bytes of state per agent, about {per_agent} with working "
        f"copies) but there is about {format_bytes(memory)} per {where}; valid: sim.agents at most {fits:_} "
        f"on {plan.world_size} rank(s), or more ranks or nodes")


def main(cfg: SimConfig, ctx: RunContext) -> int:
    import multigpu as mg
    from multigpu.sim.runner import run

    if cfg.check_split:
        from multigpu.sim.splitcheck import record

        record(cfg)  # the launcher compares what rank 0 recorded on 1 and 2 ranks
        return 0
    if cfg.differentiable:
        return _differentiable(cfg, ctx)
    if cfg.ensemble.active:
        return _ensemble(cfg, ctx)
    if not cfg.population:  # a population file is as large as it is
        cfg = dataclasses.replace(cfg, agents=cfg.agents * ctx.problem_scale(mg.world_size()))
    result = run(cfg, ctx)
    if result is not None and result.interrupted:  # --checkpoint-on-interrupt: the step's checkpoint is written
        return 128 + result.interrupted  # as a process ended by that signal: 130 for SIGINT, 143 for SIGTERM
    if result is not None:
        _report(result)
    return 0


def _ensemble(cfg: SimConfig, ctx: RunContext) -> int:
    """Replicates and sweep points over every rank; rank 0 prints the figures and where the tables are.
    Rank 0 decides which ensemble folder it continues (``ctx.resume``, or a restarted worker group:
    :func:`multigpu.sim.ensemble_resume.continued`): its replicates are kept, the others run."""
    import multigpu as mg
    from multigpu.sim.ensemble import report, run_ensemble

    scale = ctx.problem_scale(mg.world_size())  # weak scaling: more replicates, each as large as before
    if scale > 1:
        cfg = dataclasses.replace(cfg, ensemble=dataclasses.replace(cfg.ensemble,
                                                                    replicates=cfg.ensemble.replicates * scale))
    result = run_ensemble(cfg, run_dir=ctx.run_dir, ctx=ctx, progress=True)
    if result is not None:
        print("\n".join(report(result)), flush=True)
    return 0


def _differentiable(cfg: SimConfig, ctx: RunContext) -> int:
    """Calibrate against ``calibrate.target``, or run the relaxed model once (no target)."""
    import multigpu as mg
    from multigpu.sim.calibration import calibrate, relaxed_run

    if cfg.calibrate.target:
        result = calibrate(cfg, run_dir=ctx.run_dir)
        if not result.fitted:  # not a failure of the run: calibration.json says "fitted": false as well
            if mg.is_main():
                print(f"calibrate: no fit: {result.reason}", flush=True)
            return 0
        if mg.is_main():
            from multigpu.sim.api import get_model

            learn = cfg.calibrate.learn or get_model(cfg.model).learnable
            learned = ", ".join(f"{k} {result.params[k]:.5f}" for k in learn)
            print(f"calibrated in {len(result.history)} iterations: {learned} "
                  f"(loss {result.history[-1]['loss']:.3e}); history: {ctx.run_dir}/calibration.csv", flush=True)
        return 0
    series = relaxed_run(cfg)
    if mg.is_main() and ctx.run_dir:
        from pathlib import Path

        from multigpu.sim.runner import write_csv

        print(f"series (differentiable model): {write_csv(series, Path(ctx.run_dir) / 'series.csv')}", flush=True)
    return 0


def _report(result) -> None:
    s = result.summary
    last = {k: v[-1] for k, v in result.series.items() if v and k != "step"}
    print(f"sim {s['model']} ({s['strategy']}, {s['world_size']} ranks): {s['num_agents']:,} agents, "
          f"{s['final_step']} steps, {s['throughput']:,.0f} agent-steps/s "
          f"(comm {s['comm_share']:.0%}, imbalance {s['imbalance']:.2f}, "
          f"{s['bytes_per_agent']} bytes/agent, peak RSS {max(s['peak_rss_mb']):,.0f} MB per rank)")
    if last:
        print("final: " + ", ".join(f"{k} {v:,.4g}" if isinstance(v, float) else f"{k} {v:,}" for k, v in last.items()))
    for r in s["rebalances"][-1:]:
        print(f"rebalance at step {r['step']}: imbalance {r['imbalance_before']:.3f} -> {r['imbalance_after']:.3f}")
    if result.agents_path:
        print(f"agents: {result.agents_path}")
    if result.csv_path:
        print(f"series: {result.csv_path}")
    if result.plot_path:
        print(f"plot: {result.plot_path}")
    sys.stdout.flush()


def _launch(job) -> int | None:
    from multigpu.sim.splitcheck import launch_check

    return launch_check(job)



def _dry_run(cfg, plan, rank: int, report) -> None:
    """``--dry-run``'s part of this workload, as rank ``rank`` would run it (:mod:`multigpu.sim.dryrun`)."""
    from multigpu.sim.dryrun import examine

    examine(cfg, plan, rank, report)

WORKLOAD = Workload(
    name="sim",
    config=SimConfig,
    check=check,
    main=main,
    init=lambda cfg: {"backend": cfg.backend},
    launch=_launch,
    dry_run=_dry_run,
    resumable=True,
    resume_total=lambda cfg: None if cfg.ensemble.active else cfg.steps,  # an ensemble continues its replicates
    # an ensemble's design too (its sweep, seeds, rounds): the replicates on disk would be of another
    resume_keeps=("model", "seed", "grid", "agents", "params", "ensemble.sweep", "ensemble.sweep_file",
                  "ensemble.same_seeds", "ensemble.until_ci", "ensemble.ci_series", "ensemble.min_replicates"),
    # an ensemble's progress: one file per finished replicate in the run's ensemble/ folder (sim.ensemble_resume
    # decides what an ensemble continues; a simulation's Run decides its checkpoint)
    own_progress=holds_ensemble,
    help="run an agent-based simulation (movement, sir, network_sir, market, or your model) split over ranks",
    prefix="sim",
    flags=(
        Flag("--model", "model", metavar="NAME|pkg.mod:MODEL",
             help="movement | sir | network_sir | market, or your model as pkg.module:MODEL (see multigpu.sim.api)"),
        Flag("--check-split", "check_split", action="store_true",
             help="check the model instead: run it on 1 and 2 ranks (every strategy, a small population) "
                  "and compare every agent"),
        Flag("--save-agents", "save_agents", metavar="FILE",
             help="write the final agents by id: .npz, .parquet, or a folder of .npy per field (a relative "
                  "path is inside the run directory)"),
        Flag("--population", "population", metavar="FILE",
             help="read the agents from .npz, .csv, .parquet or a folder of .npy (row i = agent i)"),
        Flag("--calibrate", "calibrate.target", metavar="SERIES.csv",
             help="learn calibrate.learn (float parameters; default: the model's learnable) by gradient descent "
                  "on the differentiable model so its series match this CSV"),
        Flag("--replicates", "ensemble.replicates", type=positive_int, metavar="N",
             help="run N replicates (each its own seed) per sweep point and write the mean and band of every "
                  "series; with --until-ci: the most per point"),
        Flag("--sweep", "ensemble.sweep", action="append", metavar="NAME=V1,V2,...",
             help="run every value of a parameter or key (beta=0.02,0.05 or beta=0.01:0.1:10); repeated: a grid"),
        Flag("--sweep-file", "ensemble.sweep_file", metavar="FILE",
             help="sweep points from a CSV (header of names, a row per point) or a YAML/JSON list of mappings"),
        Flag("--until-ci", "ensemble.until_ci", metavar="LEVEL:WIDTH",
             help="add replicates in rounds until every LEVEL%% band is narrower than WIDTH times its series' "
                  "peak (95:0.01), up to --replicates"),
        Flag("--agents", "agents", type=positive_int, help="global number of agents"),
        Flag("--steps", "steps", type=non_negative_int, help="steps to run"),
        Flag("--strategy", "strategy", help="data | spatial | adaptive"),
        Flag("--sync-frequency", "sync_frequency", type=positive_int,
             help="data strategy: all-reduce fields every k steps (k > 1 is an approximation)"),
        Flag("--checkpoint-every", "checkpoint_every", type=non_negative_int, help="save the state every K steps"),
        Flag("--checkpoint-mode", "checkpoint_mode", choices=["async", "sync"],
             help="async: write checkpoints in the background (the default); sync: wait until each is on disk"),
        Flag("--checkpoint-on-interrupt", "checkpoint_on_interrupt", action="store_true",
             help="on Ctrl-C or SIGTERM, finish the current step and write a checkpoint before stopping"),
        Flag("--compile", "compile", action="store_true", help="fuse kernels with torch.compile"),
    ),
    bench=("agents=2000000", "steps=20", "plot=false"),
)
