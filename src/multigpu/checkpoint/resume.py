"""What a run continues from: decided once, in the rank entry point, for every workload.

``--resume auto`` (the newest valid checkpoint of the run directory, or none yet), ``--resume PATH``
(a ``step_*`` folder, which must verify), or a worker group restarted by torchrun's agent
(``TORCHELASTIC_RESTART_COUNT`` > 0: the run's newest valid checkpoint, whatever ``--resume`` said;
the given one only while the run has none yet) become ``ctx.resume_from``: a path or None. A workload
loads that path and never looks for checkpoints, restart counts or ``--resume`` itself.

This module knows checkpoints only. A workload whose runs keep their progress in files of their own instead (a
simulation ensemble: one file per finished replicate, :mod:`multigpu.sim.ensemble_store`) decides what such a run
continues by the same rule in its own code (``Workload.own_progress``).
"""

from __future__ import annotations

from pathlib import Path

from multigpu.checkpoint.store import CheckpointStore, describe_unusable, is_checkpoint, old_layout, verify
from multigpu.errors import ConfigError, CorruptCheckpointError, OldLayoutError

__all__ = ["CHECKPOINTS", "RESTART_VAR", "check_resume_path", "choose", "decide", "planned", "refuse_old_layout",
           "refuse_unusable", "resolve", "restart_count", "run_of"]

CHECKPOINTS = "checkpoints"
"""The store's folder inside a run directory."""

from multigpu.runtime.env import RESTART_VAR, restart_count  # noqa: E402 - re-exported: the one reader


def run_of(path: str | Path) -> Path:
    """The run folder a resume target belongs to: ``<run>/checkpoints/step_*``'s ``<run>``; a folder that holds a
    ``run.json`` (a run folder itself); else the folder ``path`` is in (``<run>/ensemble``'s ``<run>``)."""
    path = Path(path).absolute()
    if path.parent.name == CHECKPOINTS:
        return path.parent.parent
    return path if (path / "run.json").is_file() else path.parent


def check_resume_path(resume: str) -> Path:
    """``--resume PATH``: a checkpoint folder whose files match its manifest (bytes only; the launcher and
    rank 0 call this). One-line ConfigError or CorruptCheckpointError otherwise."""
    path = Path(resume)
    if not path.exists():
        raise ConfigError(f"--resume {resume}: no such file or folder (it is not a checkpoint folder); valid: auto, "
                          "or a checkpoints/step_* folder")
    what = old_layout(path.parent if path.is_file() else path)
    if not is_checkpoint(path) and what is not None:
        from multigpu.checkpoint.store import old_layout_error

        raise old_layout_error(path, what)
    if not is_checkpoint(path):
        raise ConfigError(f"--resume {resume}: not a checkpoint folder (it has no manifest.json, so nothing in it has "
                          "a checksum and it is not loaded); valid: auto, or a checkpoints/step_* folder")
    try:
        verify(path)
    except CorruptCheckpointError as exc:
        raise CorruptCheckpointError(exc.path, exc.reason) from None
    return path


def refuse_old_layout(run_dir: str | Path) -> None:
    """In the launcher, for ``--resume auto``: a run directory whose checkpoints are all of an earlier layout
    is refused in one line (:class:`~multigpu.errors.OldLayoutError`) before anything starts."""
    from multigpu.checkpoint.store import old_layout_error

    store = CheckpointStore(Path(run_dir) / CHECKPOINTS)
    what = old_layout(store.directory)
    if what is not None and not store.folders():
        raise old_layout_error(store.directory, what)


def _step_folders(directory: Path) -> list[Path]:
    """Every ``step_*`` folder (usable or not), newest first."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdecimal()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def _none_usable(directory: Path, unusable: list[tuple[Path, str]], why: str) -> ConfigError:
    """One line: checkpoints are there, none can be used (each with its reason, newest first), and what to do."""
    count = len(_step_folders(directory))
    return ConfigError(f"{why}: {directory} holds {count} checkpoint folder(s) and none can be used "
                       f"({describe_unusable(unusable)}); nothing was loaded, and the run does not start again from "
                       "step 0 over them; valid: --resume PATH of a checkpoint that verifies, move the unusable step_* "
                       "folders away, or a new --run-dir")


def refuse_unusable(run_dir: str | Path) -> None:
    """In the launcher, for ``--resume auto``: a run directory that holds checkpoint folders none of which could
    be used (a manifest that does not parse, a file it lists missing: the cheap checks, no hashing) is refused
    in one line before anything starts; the ranks verify every byte of the one they pick."""
    from multigpu.checkpoint.store import verify

    directory = Path(run_dir) / CHECKPOINTS
    unusable = []
    for path in _step_folders(directory):
        try:
            verify(path, only=())  # every listed file present, none unlisted; sizes and checksums: the ranks
            return
        except CorruptCheckpointError as exc:
            unusable.append((path, exc.reason))
    if unusable:
        raise _none_usable(directory, unusable, "--resume auto")


def choose(resume: str | None, run_dir: str | None, restarts: int, *, say=print, elastic: bool = False
           ) -> Path | None:
    """What to continue from: a checkpoint, or None (from scratch). Local: rank 0 calls it and tells the others.

    A restarted worker group and ``auto`` take the run's newest valid checkpoint; ``PATH`` is checked by
    :func:`check_resume_path`. ``say``: one line about the choice. ``elastic``: the worker
    group of an elastic job (``--nnodes MIN:MAX``), which torchrun's agent also re-forms when a node joins without
    counting a restart: every start of it is taken as a restart (the run's newest valid checkpoint, once it has one).

    Raises:
        ConfigError: checkpoint folders exist but none can be used (a run never quietly starts over them).
    """
    store = CheckpointStore(Path(run_dir) / CHECKPOINTS) if run_dir else None
    if (restarts > 0 or elastic) and store is not None:
        found = store.latest()
        what = f"restart {restarts}" if restarts > 0 else "elastic start"
        if found is not None:
            say(f"{what}: resuming from {found}")
            return found
        if store.skipped:
            raise _none_usable(store.directory, store.skipped, what)
    if not resume:
        return None
    if resume == "auto":
        found = store.latest() if store is not None else None
        if found is None:
            if store is not None and store.skipped:
                raise _none_usable(store.directory, store.skipped, "--resume auto")
            say("resume=auto: no checkpoint yet; starting from step 0")
            return None
        say(f"resuming from {found}")
        return found
    path = check_resume_path(resume)
    say(f"resuming from {path}")
    return path


def decide(ctx):
    """``ctx`` (a :class:`~multigpu.runtime.context.RunContext`) with ``resume_from`` decided: the one rule of
    what a run continues from, for a job (the rank entry point calls this before ``main``) and for a plain script
    (the run harness calls it when the context it was given is not decided yet). Call on all ranks after
    ``mg.init``. A context already decided comes back as it is: nothing is decided, or said, twice."""
    import dataclasses

    if ctx.resume_decided:
        return ctx
    found = resolve(ctx.resume, ctx.run_dir, elastic=getattr(ctx, "elastic", False))
    return dataclasses.replace(ctx, resume_from=str(found) if found else None, resume_decided=True)


def planned(resume: str | None, run_dir: str | None) -> Path | None:
    """In the launcher: what a resume would start from, as far as it can tell without reading a checkpoint's
    files: ``PATH`` itself; for ``auto`` the newest complete checkpoint folder of the run (its manifest and the
    files it lists present; the ranks then compare every checksum and skip a damaged one, see :func:`choose`)."""
    if resume is None or (resume == "auto" and not run_dir):
        return None
    if resume != "auto":
        return Path(resume)
    return CheckpointStore(Path(run_dir) / CHECKPOINTS, warn=lambda _: None).latest(checksums=False)


def resolve(resume: str | None, run_dir: str | None, *, restarts: int | None = None,
            elastic: bool = False) -> Path | None:
    """:func:`choose` on rank 0, the same answer (or the same one-line error) on every rank. Call on all ranks
    after ``mg.init`` (a single process needs no group). ``restarts``: default :func:`restart_count`;
    ``elastic``: as :func:`choose`'s."""
    from multigpu.runtime import collectives, group

    restarts = restart_count() if restarts is None else restarts
    if resume is None and restarts == 0 and not elastic:
        return None  # nothing to resume: the same on every rank, without a collective
    many = group.is_initialized() and group.world_size() > 1
    choice = error = None
    if not many or group.rank() == 0:
        try:
            found = choose(resume, run_dir, restarts, say=lambda line: print(line, flush=True), elastic=elastic)
            choice = str(found) if found is not None else None
        except CorruptCheckpointError as exc:
            error = ("corrupt", (str(exc.path), exc.reason))
        except OldLayoutError as exc:
            error = ("old", str(exc))
        except ConfigError as exc:
            error = ("config", str(exc))
    if many:
        choice, error = collectives.broadcast_object((choice, error))
    if error is not None:
        kind, detail = error
        if kind == "corrupt":
            raise CorruptCheckpointError(*detail)
        raise OldLayoutError(detail) if kind == "old" else ConfigError(detail)
    return Path(choice) if choice else None
