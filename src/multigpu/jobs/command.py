"""From a command line to ranks, the same way for every workload (runs in the launcher).

    multigpu <workload> [-f FILE|PRESET] [key=value ...] [--set key=value] [--run-dir DIR]
                        [--resume auto|PATH] [workload flags] [launcher flags]

1. the config: the file (or the workload's preset), then the workload's shortcut
   flags (``--agents N``), then the ``key=value`` overrides, into the frozen config class;
   with ``--resume`` the run's own ``run.json`` config replaces the preset, what is
   given again applies on top, and a key the workload keeps (``resume_keeps``) given
   with another value is one line naming it; a workload that cannot resume
   (``Workload.resumable`` False) refuses ``--resume`` here;
2. the device plan, once, and the workload's ``check(cfg, plan)``: everything
   that can be wrong with the input fails here with one line and exit code 2,
   before a folder exists or a process starts (a workload that continues files of its own,
   ``Workload.own_progress``, checks them there too);
3. the run directory (:func:`choose_run_dir`): one already used is refused
   unless ``--resume`` continues it, and the launcher holds its lock for the
   whole run (:mod:`multigpu.launch.rundir`: two runs never share a folder; a
   full disk or a read-only folder is one line, exit 2, before anything starts);
   the launcher writes ``run.json`` there (workload, resolved config, run
   context) and starts ``multigpu.jobs.rank`` on every worker, which calls the
   workload's ``main``.

``multigpu bench`` and ``multigpu verify`` call :func:`prepare` and
:func:`launch_job` with another run context; nothing else differs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multigpu.cmdline import add_flag
from multigpu.config import apply_overrides, from_dict, load_yaml, to_dict
from multigpu.errors import ConfigError
from multigpu.jobs.workload import JobPlan, Workload
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import HostFacts, plan_devices
from multigpu.launch.flags import add_dry_run_flags, add_launch_flags, config_from_args
from multigpu.runtime.context import RunContext

__all__ = ["Job", "add_config_flags", "add_overrides_arg", "add_workload_flags", "add_workload_parser", "choose_run_dir",
           "flag_values", "launch_job", "load_workload_config", "overrides_from_args", "prepare", "run_command"]

RUNS = Path("runs")
"""Run directories of workload commands: ``runs/<workload>/<YYYYmmdd-HHMMSS>[-N]``."""

RANK_ENTRY = "multigpu.jobs.rank"


@dataclass(frozen=True)
class Job:
    """A checked job, ready to launch: the workload, its resolved config and the plan it was checked against."""

    workload: Workload
    spec: str
    """How the ranks find the workload: a built-in name or ``pkg.module:NAME``."""
    config: Any
    plan: JobPlan


# ----------------------------------------------------------------------------- command line
def _flag_dest(key: str) -> str:
    return "flag__" + key.replace(".", "__")


def add_workload_parser(subparsers, workload: Workload, *, name: str | None = None,
                        help: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``multigpu <workload>``: config, overrides, run directory, resume, shortcuts, launcher flags."""
    text = help or workload.help
    parser = subparsers.add_parser(name or workload.name, help=text, description=text)
    add_config_flags(parser, workload)
    add_common_job_flags(parser)
    add_workload_flags(parser, workload)
    add_launch_flags(parser)
    add_dry_run_flags(parser)
    add_overrides_arg(parser, workload)
    return parser


def add_config_flags(parser: argparse.ArgumentParser, workload: Workload) -> None:
    """``-f FILE|PRESET`` and ``--set KEY=VALUE``: where the workload's config comes from."""
    default = f"the preset '{workload.preset}'" if workload.preset else "the built-in defaults"
    parser.add_argument("-f", "--config", metavar="FILE|PRESET", default=None,
                        help=f"YAML config: a path or a packaged preset name (default: {default})")
    parser.add_argument("--set", dest="set_overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, repeatable (the same as a positional key=value)")


def add_workload_flags(parser: argparse.ArgumentParser, workload: Workload) -> None:
    """The workload's shortcut flags (``--agents N`` for ``agents=N``), in a group of their own."""
    if workload.flags:
        group = parser.add_argument_group(workload.name)
        for flag in workload.flags:
            add_flag(group, flag.name, dest=_flag_dest(flag.key), default=None, **_flag_kwargs(flag))


def add_overrides_arg(parser: argparse.ArgumentParser, workload: Workload) -> None:
    """The positional ``key=value`` overrides (:func:`multigpu.cmdline.parse` takes them between flags too)."""
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help=f"config overrides, e.g. {' '.join(override_examples(workload))}")


def _flag_kwargs(flag) -> dict[str, Any]:
    """The flag's argparse settings; one that takes a value shows its config key (``--agents AGENTS``), not
    argparse's ``FLAG__AGENTS`` made from the internal destination."""
    kwargs = dict(flag.kwargs)
    if kwargs.get("action", "store") in ("store", "append") and "metavar" not in kwargs and "choices" not in kwargs:
        kwargs["metavar"] = flag.key.rpartition(".")[2].upper()
    return kwargs


def override_examples(workload: Workload, count: int = 2) -> list[str]:
    """``key=value`` examples for ``--help`` taken from the config class itself (its first plain settings with
    their defaults), so every example is one the workload accepts."""
    out = []
    for f in dataclasses.fields(workload.config):
        if type(f.default) in (int, float) and not f.name.startswith("_"):
            out.append(f"{f.name}={f.default}")
        if len(out) == count:
            break
    return out


def add_common_job_flags(parser: argparse.ArgumentParser) -> None:
    """``--run-dir`` and ``--resume``: the same on every workload command."""
    add_flag(parser, "--run-dir", default=None, metavar="DIR", help=f"output folder (default {RUNS}/<workload>/<time>)")
    add_flag(parser, "--resume", default=None, metavar="auto|PATH",
             help="auto: continue from the newest valid checkpoint (of --run-dir, else of the newest run), or "
                  "a run's ensemble folder (sim); PATH: a checkpoints/step_* folder, or an ensemble folder. The "
                  "run's own config (run.json) is reused; keys given again apply where the workload allows")


def _set_key(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_workload_config(workload: Workload, config: str | None, overrides: list[str],
                         flags: dict[str, Any] | None = None, *, base: dict[str, Any] | None = None,
                         defaults: Sequence[str] = ()) -> Any:
    """The workload's config: the file (or preset; ``base``, a resumed run's own config, under the file), then
    ``defaults`` (``key=value``: bench's shorter runs), then the flag values, then ``key=value`` overrides: what
    the user typed wins, in whatever form.

    ``base``: a resumed run's own config (its run.json): it replaces the preset, and a file given with
    ``-f`` applies on top of it, like the flags and overrides.

    Naming another factory (``--model pkg.mod:fn`` or ``model.factory=...``) drops the ``kwargs`` the file
    gave the one it replaces: they belonged to that factory. Overrides of ``model.kwargs.*`` still apply.
    """
    if base is not None:
        data = _merged(base, load_yaml(config)) if config else dict(base)
    else:
        source = config or workload.preset
        data = load_yaml(source) if source else {}
    data = apply_overrides(data, list(defaults))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"argument {item!r} is not a key=value override (e.g. steps=100)")
    for key, value in (flags or {}).items():
        if value is None:
            continue
        if key.endswith("kwargs") and isinstance(value, list):  # --model-arg a=1 --model-arg b=x
            data = apply_overrides(data, [f"{key}.{item}" if "=" in item else item for item in value])
            continue
        _set_factory_or_key(data, key, list(value) if isinstance(value, tuple) else value)
    factories = [o for o in overrides if o.partition("=")[0].strip().endswith(".factory")]
    for item in factories:
        key, _, value = item.partition("=")
        _set_factory_or_key(data, key.strip(), value.strip())
    data = apply_overrides(data, [o for o in overrides if o not in factories])
    return from_dict(workload.config, data, prefix=workload.prefix)


def _set_factory_or_key(data: dict[str, Any], key: str, value: Any) -> None:
    section, _, leaf = key.rpartition(".")
    if leaf == "factory" and section:
        node = data
        for part in section.split("."):
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        if node.get("factory") != value:
            node.pop("kwargs", None)
    _set_key(data, key, value)


def flag_values(workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """The workload's shortcut flags as given (``{config key: value}``; None where not given)."""
    return {flag.key: getattr(args, _flag_dest(flag.key), None) for flag in workload.flags}


# ----------------------------------------------------------------------------- resume
def saved_config(workload: Workload, run_dir: Path, resume: str | None) -> dict[str, Any] | None:
    """The config a resumed run was started with (its run.json), or None: none is there to reuse.

    ``run_dir``'s run.json; for ``--resume PATH`` into a new folder, the one of the run that wrote PATH
    (``<run>/checkpoints/step_*``, a folder of the workload's own in ``<run>``, or that run folder itself:
    :func:`multigpu.checkpoint.resume.run_of`)."""
    import json

    from multigpu.checkpoint.resume import planned, run_of

    if not resume:
        return None
    candidates = [run_dir / "run.json"]
    if resume != "auto":
        candidates.append(run_of(planned(resume, None)) / "run.json")
    for path in candidates:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
            continue
        other = data.get("workload")
        if other not in (workload.name, None) and ":" not in str(other):
            raise ConfigError(f"--resume: {path.parent} is a {other} run, not a {workload.name} run; valid: "
                              f"multigpu {other} --resume ..., or another --run-dir")
        return data["config"]
    return None


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        return {k: v for key, value in data.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): data}


def checkpoint_config(workload: Workload, resume: str | None, run_dir: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a resume would start from (:func:`multigpu.checkpoint.resume.planned`) and the config it
    records (its manifest's ``meta.config``: the run harness records the job's settings in every checkpoint); None
    for a checkpoint that records none (an older one), anything but a checkpoint, or no resume. Reads the manifest
    only."""
    from multigpu.checkpoint.resume import planned
    from multigpu.checkpoint.store import is_checkpoint, read_manifest
    from multigpu.errors import CorruptCheckpointError

    if not resume:
        return None
    target = planned(resume, str(run_dir))
    if target is None or not is_checkpoint(target):
        return None
    try:
        meta = read_manifest(target).get("meta")
    except CorruptCheckpointError:  # the ranks say what is wrong with it (or skip it, for auto)
        return None
    config = meta.get("config") if isinstance(meta, dict) else None
    return (target, config) if isinstance(config, dict) and config else None


def check_not_past(workload: Workload, cfg: Any, resume: str | None, run_dir: Path) -> None:
    """A resume from a checkpoint at step N of a config that counts to fewer steps would run nothing (and end as if
    it had): one line (``Workload.resume_total``; reads the manifest only)."""
    from multigpu.checkpoint.resume import planned
    from multigpu.checkpoint.store import is_checkpoint, read_manifest
    from multigpu.errors import CorruptCheckpointError

    total = workload.resume_total(cfg) if resume and workload.resume_total is not None else None
    target = planned(resume, str(run_dir)) if total is not None else None
    if target is None or not is_checkpoint(target):
        return
    try:
        step = int(read_manifest(target)["step"])
    except CorruptCheckpointError:  # the ranks say what is wrong with it (or skip it, for auto)
        return
    if step > total:
        raise ConfigError(f"--resume: {target} is at step {step:,}, past the {total:,} steps this {workload.name} "
                          f"run is set to: nothing would run; valid: more steps than {step:,}, or a new --run-dir "
                          "without --resume")


def set_aside_later(workload: Workload, run_dir: Path, resume: Path) -> Path | None:
    """``--resume PATH`` of one of this run's own checkpoints, with later ones beside it, rewinds the run: its later
    checkpoints are moved (never deleted) into ``checkpoints/abandoned_<time>/`` and one line says so. Left there,
    ``--resume auto`` continued them, not the new branch, and rotation deleted the new branch's steps (the old,
    higher ones counted as newer). Returns the folder they went to (None: nothing to set aside). Holding the run's
    lock."""
    import re
    import time

    from multigpu.checkpoint import CHECKPOINTS
    from multigpu.checkpoint.store import is_checkpoint

    folder = (run_dir / CHECKPOINTS).resolve()
    step_of = re.compile(r"^step_(\d+)$")
    here = resume.resolve()
    if here.parent != folder or not is_checkpoint(here) or (m := step_of.match(here.name)) is None:
        return None
    later = sorted(p for p in folder.iterdir() if (n := step_of.match(p.name)) and int(n[1]) > int(m[1]))
    if not later:
        return None
    aside = folder / f"abandoned_{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
    print(f"multigpu {workload.name}: resuming {resume} rewinds this run: its later checkpoints "
          f"({', '.join(p.name for p in later)}) are set aside in {run_dir / CHECKPOINTS / aside.name} (never deleted), "
          "and --resume auto continues this branch from now on", flush=True)
    return aside


def check_kept(workload: Workload, saved: dict[str, Any], cfg: Any, where: str = "the run being resumed") -> None:
    """A resumed run keeps the keys its workload names in ``resume_keeps``: one line naming the first that
    changed from ``saved`` (the config of ``where``: the run's ``run.json``, or the checkpoint's own record)."""
    before = _flat(to_dict(from_dict(workload.config, saved, prefix=workload.prefix)))
    now = _flat(to_dict(cfg))
    keeps = workload.resume_keeps
    for key in sorted(set(before) | set(now)):
        if not any(key == k or key.startswith(k + ".") for k in keeps) or before.get(key) == now.get(key):
            continue
        raise _changed(workload, key, now.get(key), before.get(key), where)


def _changed(workload: Workload, key: str, now: Any, before: Any, where: str) -> ConfigError:
    name = f"{workload.prefix}.{key}" if workload.prefix else key
    return ConfigError(f"--resume: {name} is {now!r} here but {before!r} in {where}, and a resumed {workload.name} run "
                       f"keeps {', '.join(workload.resume_keeps)}; valid: leave it out (the run's own config is "
                       "used), or start a new --run-dir without --resume")


def check_given_kept(workload: Workload, saved: dict[str, Any], overrides: Sequence[str],
                     flags: dict[str, Any] | None, where: str = "the run being resumed") -> None:
    """Before a resumed run's config is built on its own: a key the workload keeps, given as a plain value that
    differs (``--model market`` on a sir run), is named, not what building the config then trips on (the old
    model's parameters: "unknown config key 'sim.params.move_prob'")."""
    given = {key: value for key, value in (flags or {}).items() if value is not None}
    for item in overrides:
        key, sep, _ = item.partition("=")
        if sep and key.strip():
            given.update(_flat(apply_overrides({}, [item])))
    before = _flat(saved)
    plain = (str, int, float, bool)
    for key, value in given.items():
        old = before.get(key)
        if key in workload.resume_keeps and isinstance(value, plain) and isinstance(old, plain) and old != value:
            raise _changed(workload, key, value, old, where)


def overrides_from_args(workload: Workload, args: argparse.Namespace, launch_cfg: LaunchConfig) -> list[str]:
    """The ``key=value`` overrides of a workload command line: positional, ``--set``, and accelerate's
    ``--mixed-precision`` as the workload's ``precision``."""
    overrides = [*args.overrides, *args.set_overrides]
    if launch_cfg.mixed_precision is not None:
        if "precision" not in {f.name for f in dataclasses.fields(workload.config)}:
            raise ConfigError(f"--mixed-precision: the {workload.name} workload has no precision setting")
        overrides.append(f"precision={launch_cfg.mixed_precision}")
    return overrides


# ----------------------------------------------------------------------------- run directory
def latest_run(workload: str, root: Path = RUNS, *, own_progress: Callable[[Path], bool] | None = None
               ) -> Path | None:
    """The newest run of ``workload`` that holds a checkpoint, or progress of the workload's own (``own_progress``,
    ``Workload.own_progress``): what ``--resume auto`` continues."""
    folder = root / workload
    if not folder.is_dir():
        return None
    runs = [p for p in folder.iterdir() if ((p / "checkpoints").is_dir() and any((p / "checkpoints").iterdir()))
            or (own_progress is not None and p.is_dir() and own_progress(p))]
    return max(runs, key=lambda p: p.name) if runs else None


def choose_run_dir(workload: str, run_dir: str | None, resume: str | None, root: Path = RUNS, *,
                   own_progress: Callable[[Path], bool] | None = None) -> tuple[Path, bool]:
    """The run directory and whether it is new: ``--run-dir``; with ``--resume auto`` alone, the newest run
    that has a checkpoint (or progress of the workload's own: ``own_progress``); else a fresh
    ``runs/<workload>/<time>`` (made unique by :func:`create_run_dir`)."""
    if run_dir:
        return Path(run_dir), False
    if resume == "auto":
        previous = latest_run(workload, root, own_progress=own_progress)
        if previous is not None:
            return previous, False
    return root / workload / time.strftime("%Y%m%d-%H%M%S"), True


def create_run_dir(path: Path, fresh: bool) -> Path:
    """Create the run directory. A fresh one never reuses a folder: two runs started in the same second get
    ``<time>``, ``<time>-2``, ... (``mkdir`` is atomic, so this holds across processes).

    Raises:
        OutputError: the folder cannot be created (read-only file system, permission), naming it.
    """
    from multigpu.launch import rundir

    if not fresh:
        rundir.create(path)
        return path
    rundir.create(path.parent)
    candidate, n = path, 1
    while True:
        try:
            candidate.mkdir(mode=0o700)  # this user's only, as rundir.create makes it
            return candidate
        except FileExistsError:
            n += 1
            candidate = path.with_name(f"{path.name}-{n}")
        except OSError as exc:
            raise rundir.cannot_create(candidate, exc) from exc


# ----------------------------------------------------------------------------- the job
def prepare(workload: Workload, config: Any, launch_cfg: LaunchConfig, ctx: RunContext, *,
            spec: str | None = None, facts: HostFacts | None = None) -> Job:
    """Plan the devices (once) and run the workload's ``check``. Writes nothing, starts nothing."""
    devices = plan_devices(launch_cfg, facts or HostFacts.probe())
    plan = JobPlan(launch_cfg, devices, devices.nproc_per_node * launch_cfg.nnodes, ctx)
    if workload.check is not None:
        config = workload.check(config, plan) or config
    return Job(workload, spec or workload.name, config, plan)


def launch_job(job: Job, ctx: RunContext | None = None) -> None:
    """Launch the checked job; ``ctx`` replaces the run context it was checked with (bench, verify). Its
    ``run.json`` also keeps the world size it is launched at (what a resume compares with: :func:`say_resized`)."""
    from multigpu.launch.agent import launch

    launch(job.plan.launch, RANK_ENTRY, [], module=True, devices=job.plan.devices, ctx=ctx or job.plan.ctx,
           job={"workload": job.spec, "config": to_dict(job.config), "world_size": job.plan.world_size})


_SAYS_ITS_OWN_RESIZE = ("train",)
"""Workloads whose check says a resize itself, with what it does about it (train keeps the global batch)."""


def resumed_world_size(run_dir: Path, target: Path | None) -> int | None:
    """The world size of the run a resume continues: its checkpoint's (the manifest's ``world_size``), else (files of
    the workload's own) that run's last launch (its ``run.json``); None where neither says."""
    import json

    from multigpu.checkpoint.resume import run_of
    from multigpu.checkpoint.store import is_checkpoint, read_manifest

    with contextlib.suppress(Exception):  # a damaged file: the ranks say what is wrong with it
        if target is not None and is_checkpoint(target):
            return int(read_manifest(target)["world_size"])
    run_file = (run_of(target) if target is not None else run_dir) / "run.json"
    with contextlib.suppress(OSError, ValueError, TypeError):
        size = json.loads(run_file.read_text()).get("world_size")
        return size if isinstance(size, int) and size > 0 else None
    return None


def say_resized(workload: Workload, run_dir: Path, target: Path | None, world_size: int, nnodes: int) -> None:
    """One line when a resume runs at another world size than the run it continues (all workloads)."""
    if workload.name in _SAYS_ITS_OWN_RESIZE:
        return
    before = resumed_world_size(run_dir, target)
    if before is None or before == world_size:
        return
    how = f" (--nproc-per-node {before} runs it at the size it ran)" if nnodes == 1 else ""
    print(f"multigpu {workload.name}: resuming a run of {before} rank(s) on {world_size} rank(s){how}", flush=True)


def preload(workload: Workload) -> None:
    """What the workload's ranks will import, imported once by the command line's fork server meanwhile."""
    from multigpu.launch import forkserver

    forkserver.preload([getattr(workload.main, "__module__", ""), *workload.preload])


def resume_command(argv: Sequence[str] | None, run_dir: Path, nnodes: int) -> str | None:
    """The whole command that continues the run in ``run_dir``: the job's own command line (``--nproc-per-node``,
    node flags and all) with ``--run-dir`` that folder and ``--resume auto``; ``--node-rank`` left out on several
    nodes (each node gives its own). None when the command line is not known."""
    import shlex

    if not argv:
        return None
    drop = {"--run-dir", "--run_dir", "--resume"} | ({"--node-rank", "--node_rank"} if nnodes > 1 else set())
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in drop:
            skip = "=" not in arg
            continue
        out.append(arg)
    line = shlex.join(["multigpu", *out, "--run-dir", str(run_dir), "--resume", "auto"])
    return line + (" (on every node, each with its --node-rank)" if nnodes > 1 and len(out) < len(argv) else "")


def run_command(workload: Workload, args: argparse.Namespace, *, spec: str | None = None) -> int:
    """``multigpu <workload> ...``: config, check, run directory, launch.

    On several nodes the launchers meet before anything is written (:mod:`multigpu.launch.nodes`): node 0
    settles the run folder (one per job) and every node checks that it sees it; a node that fails before the
    job forms stops the others, naming it.
    """
    from multigpu.launch import nodes

    preload(workload)
    launch_cfg = config_from_args(args)  # also translates other launchers' flags
    if args.dry_run:
        return _run_command(workload, args, launch_cfg, None, spec)
    with nodes.joined(launch_cfg) as session:
        return _run_command(workload, args, nodes.placed(launch_cfg, session), session, spec)


def _run_command(workload: Workload, args: argparse.Namespace, launch_cfg: LaunchConfig, session,
                 spec: str | None) -> int:
    from multigpu.launch import rundir

    overrides = overrides_from_args(workload, args, launch_cfg)
    if args.resume is not None and not workload.resumable:
        raise ConfigError(f"--resume {args.resume}: the {workload.name} workload cannot resume (it writes no "
                          f"checkpoints); valid: run it again without --resume")
    run_dir, fresh = choose_run_dir(workload.name, args.run_dir, args.resume, own_progress=workload.own_progress)
    agreed = session is not None and args.run_dir is None  # the nodes take node 0's folder
    if agreed and args.resume == "auto":  # node 0's newest run, not each node's own
        name = session.agree("resumed_run", lambda: "" if fresh else run_dir.name)
        run_dir, fresh = (RUNS / workload.name / name, False) if name else (run_dir, True)
    if args.resume == "auto":
        from multigpu.checkpoint.resume import refuse_old_layout, refuse_unusable

        refuse_old_layout(run_dir)
        refuse_unusable(run_dir)  # checkpoints, none usable: one line, never a quiet start from step 0
    saved = saved_config(workload, run_dir, args.resume)  # --resume: the run's own config, then what is given
    recorded = checkpoint_config(workload, args.resume, run_dir)  # what the checkpoint itself says it was made with
    where = "the run being resumed"
    if saved is None and recorded is not None:  # a checkpoint away from its run folder: its own record is the config
        saved, where = recorded[1], f"the checkpoint {recorded[0]}"
    if saved is not None:
        check_given_kept(workload, saved, overrides, flag_values(workload, args), where)
    cfg = load_workload_config(workload, args.config, overrides, flag_values(workload, args), base=saved)
    if recorded is not None:  # the checkpoint's own record first: run.json may be of another run, or replaced
        check_kept(workload, recorded[1], cfg, where=f"the checkpoint {recorded[0]}")
    if saved is not None:
        check_kept(workload, saved, cfg)
    check_not_past(workload, cfg, args.resume, run_dir)
    if args.dry_run:  # the job at --world-size N in this process: before any folder exists
        from multigpu.jobs.dryrun import dry_run

        return dry_run(workload, cfg, launch_cfg, args)
    if args.world_size is not None or args.device_memory is not None:
        raise ConfigError("--world-size and --device-memory are the dry run's; add --dry-run, or use "
                          "--nproc-per-node/--nnodes for a real job")
    # a used folder is continued (--resume) or refused; on several nodes each writes there, so only the lock counts
    fresh_only = args.resume is None and launch_cfg.nnodes == 1
    if fresh_only:
        rundir.refuse_used(run_dir, hint=_USED_HINT)
    ctx = RunContext(run_dir=str(run_dir.resolve()), resume=args.resume)
    job = prepare(workload, cfg, launch_cfg, ctx, spec=spec)  # bad input ends here: nothing written yet
    if args.resume is not None:
        from multigpu.checkpoint.resume import planned

        say_resized(workload, run_dir, planned(args.resume, str(run_dir)), job.plan.world_size, launch_cfg.nnodes)
    if session is not None and session.node_rank != 0:
        if agreed:  # node 0 made the folder: its name, under this node's runs/<workload>
            run_dir, fresh = RUNS / workload.name / session.agree("run_name", lambda: ""), False
        elif args.resume is None:  # a run that has ended there: this node came too late (before any wait)
            rundir.refuse_ended(run_dir, session.node_rank, alive=session.store_answers)
        session.check_shared(run_dir)  # before this node writes anything there
    else:
        rundir.check_free_space(run_dir)
        run_dir = create_run_dir(run_dir, fresh)
        if session is not None:
            try:
                if agreed:
                    session.agree("run_name", lambda: run_dir.name)
                session.check_shared(run_dir)
            except BaseException:
                if fresh:  # the folder made for this job, still empty: nothing half-written is left
                    with contextlib.suppress(OSError):
                        run_dir.rmdir()
                raise
    with rundir.hold(run_dir, node_rank=launch_cfg.node_rank, fresh_only=fresh_only, hint=_USED_HINT):
        if args.resume not in (None, "auto") and (session is None or session.node_rank == 0):
            set_aside_later(workload, run_dir, Path(args.resume))
        if not fresh and args.run_dir is None and args.resume == "auto":
            print(f"multigpu {workload.name}: --resume auto continues {run_dir}", flush=True)
        command = resume_command(getattr(args, "_argv", None), run_dir.resolve(), launch_cfg.nnodes) \
            if workload.resumable else None
        job = dataclasses.replace(job, plan=dataclasses.replace(job.plan, ctx=dataclasses.replace(
            ctx, run_dir=str(run_dir.resolve()), resume_command=command)))
        if workload.launch is not None:
            code = workload.launch(job)
            if code is not None:
                return code
        print(f"multigpu {workload.name}: {job.plan.world_size} rank(s), run directory {run_dir}", flush=True)
        launch_job(job)
    return 0


_USED_HINT = "valid: --resume auto to continue that run, or a new --run-dir (or none: a fresh runs/<workload>/<time>)"
