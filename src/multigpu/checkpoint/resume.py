"""What a run continues from: decided once, in the rank entry point, for every workload.

``--resume auto`` (the newest valid checkpoint of the run directory, or none yet), ``--resume PATH``
(a ``step_*`` folder, which must verify), or a worker group restarted by torchrun's agent
(``TORCHELASTIC_RESTART_COUNT`` > 0: the run's newest valid checkpoint, whatever ``--resume`` said;
the given one only while the run has none yet) become ``ctx.resume_from``: a path or None. A workload
loads that path and never looks for checkpoints, restart counts or ``--resume`` itself.

A workload whose progress is files of its own rather than checkpoints (a simulation ensemble: one file per
finished replicate) names their folder (``progress``: ``Workload.progress``, ``Run(progress=...)``); its
``manifest.json`` says what the work is (:func:`check_design`). The same rule then decides for that folder
where a run has no checkpoint: ``auto`` and a restart continue the run's own folder, and ``PATH`` may be such
a folder of another run (or the run folder that holds it). ``resume_from`` is then that folder, and the
workload reads what is done from its files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from multigpu.checkpoint.store import CheckpointStore, describe_unusable, is_checkpoint, old_layout, verify
from multigpu.errors import ConfigError, CorruptCheckpointError, OldLayoutError

__all__ = ["CHECKPOINTS", "RESTART_VAR", "check_design", "check_resume_path", "choose", "decide", "is_progress",
           "planned", "progress_folder", "refuse_old_layout", "refuse_unusable", "resolve", "restart_count", "run_of"]

CHECKPOINTS = "checkpoints"
"""The store's folder inside a run directory."""

from multigpu.runtime.env import RESTART_VAR, restart_count  # noqa: E402 - re-exported: the one reader

PROGRESS_MANIFEST = "manifest.json"
"""In a folder of progress files: what the work is (the workload's design), written before any progress."""


def progress_folder(run_dir: str | Path | None, progress: str | None) -> Path | None:
    """The run's folder of progress files (``<run_dir>/<progress>``, once its manifest is written), or None."""
    if not run_dir or not progress:
        return None
    folder = Path(run_dir) / progress
    return folder if (folder / PROGRESS_MANIFEST).is_file() else None


def is_progress(path: str | Path | None, progress: str | None) -> bool:
    """Whether ``path`` is a folder of progress files named ``progress`` (not a checkpoint)."""
    return path is not None and progress is not None and Path(path).name == progress and \
        (Path(path) / PROGRESS_MANIFEST).is_file()


def run_of(path: str | Path) -> Path:
    """The run folder a resume target belongs to: ``<run>/checkpoints/step_*`` or ``<run>/<progress>``."""
    path = Path(path).absolute()
    return path.parent.parent if path.parent.name == CHECKPOINTS else path.parent


def _valid(progress: str | None) -> str:
    return "auto, or a checkpoints/step_* folder" + (f", or a run's {progress}/ folder (or the run folder that "
                                                     "holds one)" if progress else "")


def check_resume_path(resume: str, *, progress: str | None = None) -> Path:
    """``--resume PATH``: a checkpoint folder whose files match its manifest (bytes only; the launcher and
    rank 0 call this), or, for a workload with a folder of progress files (``progress``), such a folder or the
    run folder that holds one (returned as the folder itself). One-line ConfigError or CorruptCheckpointError
    otherwise."""
    path = Path(resume)
    if not path.exists():
        if progress:
            raise ConfigError(f"--resume {resume}: no such file or folder (it is not a checkpoint folder nor a run's "
                              f"{progress}/ folder); valid: {_valid(progress)}")
        raise ConfigError(f"--resume {resume}: no such file or folder (it is not a checkpoint folder); valid: auto, "
                          "or a checkpoints/step_* folder")
    if is_progress(path, progress):
        return path
    if progress and path.name != progress and (found := progress_folder(path, progress)) is not None:
        return found
    what = old_layout(path.parent if path.is_file() else path)
    if not is_checkpoint(path) and what is not None:
        from multigpu.checkpoint.store import old_layout_error

        raise old_layout_error(path, what)
    if not is_checkpoint(path):
        nor = f" nor a run's {progress}/ folder" if progress else ""
        raise ConfigError(f"--resume {resume}: not a checkpoint folder{nor} (it has no manifest.json, so nothing in "
                          f"it has a checksum and it is not loaded); valid: {_valid(progress)}")
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


def choose(resume: str | None, run_dir: str | None, restarts: int, *, progress: str | None = None,
           say=print, elastic: bool = False) -> Path | None:
    """What to continue from: a checkpoint, a folder of progress files (``progress``: its name in a run
    folder, for a workload that keeps one), or None (from scratch). Local: rank 0 calls it and tells the others.

    A restarted worker group and ``auto`` take the run's newest valid checkpoint, else its own progress folder;
    ``PATH`` is checked by :func:`check_resume_path`. ``say``: one line about the choice. ``elastic``: the worker
    group of an elastic job (``--nnodes MIN:MAX``), which torchrun's agent also re-forms when a node joins without
    counting a restart: every start of it is taken as a restart (the run's newest valid checkpoint, once it has one).

    Raises:
        ConfigError: checkpoint folders exist but none can be used (a run never quietly starts over them).
    """
    store = CheckpointStore(Path(run_dir) / CHECKPOINTS) if run_dir else None
    own = progress_folder(run_dir, progress)
    if (restarts > 0 or elastic) and store is not None:
        found = store.latest()
        what = f"restart {restarts}" if restarts > 0 else "elastic start"
        if found is not None:
            say(f"{what}: resuming from {found}")
            return found
        if store.skipped:
            raise _none_usable(store.directory, store.skipped, what)
        if own is not None:
            say(f"{what}: continuing {own}")
            return own
    if not resume:
        return None
    if resume == "auto":
        found = store.latest() if store is not None else None
        if found is None:
            if store is not None and store.skipped:
                raise _none_usable(store.directory, store.skipped, "--resume auto")
            if own is not None:
                say(f"continuing {own}")
                return own
            say(f"resume=auto: no checkpoint{f' nor {progress}/ folder' if progress else ''} yet; starting from "
                "step 0")
            return None
        say(f"resuming from {found}")
        return found
    path = check_resume_path(resume, progress=progress)
    say(f"{'continuing' if is_progress(path, progress) else 'resuming from'} {path}")
    return path


def decide(ctx, *, progress: str | None = None):
    """``ctx`` (a :class:`~multigpu.runtime.context.RunContext`) with ``resume_from`` decided: the one rule of
    what a run continues from (a checkpoint, or the folder of progress files named ``progress``), for a job (the
    rank entry point calls this before ``main``) and for a plain script (the run harness calls it when the
    context it was given is not decided yet). Call on all ranks after ``mg.init``. A context already decided
    comes back as it is: nothing is decided, or said, twice."""
    import dataclasses

    if ctx.resume_decided:
        return ctx
    found = resolve(ctx.resume, ctx.run_dir, progress=progress, elastic=getattr(ctx, "elastic", False))
    return dataclasses.replace(ctx, resume_from=str(found) if found else None, resume_decided=True)


def check_design(folder: str | Path, design: dict[str, Any]) -> None:
    """A run that continues the progress folder ``folder`` must be of the work its ``manifest.json`` describes:
    ``design`` (what the workload's ``resume_design`` makes of this run's config) compared key by key, the
    manifest's own ``format`` and ``created`` aside. One-line ConfigError naming the first key that differs; the
    launcher calls it for a job before anything starts, and the workload again where it opens the folder (a
    plain script)."""
    import json

    path = Path(folder) / PROGRESS_MANIFEST
    try:
        before = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise ConfigError(f"--resume: {path} cannot be read ({exc}); valid: a new --run-dir") from None
    if not isinstance(before, dict):
        raise ConfigError(f"--resume: {path} is not a manifest (a JSON object); valid: a new --run-dir")
    old = {k: v for k, v in before.items() if k not in ("format", "created")}
    new = json.loads(json.dumps(design))  # tuples as lists, keys as strings: as the manifest holds them
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            raise ConfigError(f"--resume: the {Path(folder).name} in {Path(folder).parent} has another {key} "
                              f"({_short(old.get(key))}, now {_short(new.get(key))}); what it holds would not be "
                              "of this run's design; valid: the same settings it was started with (the ones "
                              "that only say how much to run or how to run it may change), or a new --run-dir")


def _short(value: Any) -> str:
    import json

    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def planned(resume: str | None, run_dir: str | None, *, progress: str | None = None) -> Path | None:
    """In the launcher: what a resume would start from, as far as it can tell without reading a checkpoint's
    files: ``PATH`` itself (a run folder holding a ``progress`` folder: that folder); for ``auto`` the newest
    complete checkpoint folder of the run (its manifest and the files it lists present; the ranks then compare
    every checksum and skip a damaged one, see :func:`choose`), else the run's own progress folder."""
    if resume is None or (resume == "auto" and not run_dir):
        return None
    if resume != "auto":
        path = Path(resume)
        if progress and not is_progress(path, progress) and (found := progress_folder(path, progress)) is not None:
            return found
        return path
    found = CheckpointStore(Path(run_dir) / CHECKPOINTS, warn=lambda _: None).latest(checksums=False)
    return found if found is not None else progress_folder(run_dir, progress)


def resolve(resume: str | None, run_dir: str | None, *, restarts: int | None = None,
            progress: str | None = None, elastic: bool = False) -> Path | None:
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
            found = choose(resume, run_dir, restarts, progress=progress, say=lambda line: print(line, flush=True),
                           elastic=elastic)
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
