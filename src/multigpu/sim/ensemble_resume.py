"""What an ensemble run continues: its progress is its folder of replicates, not a checkpoint (both sides).

An ensemble writes no checkpoints: the replicates it finished are its state, one file each in its folder
(:mod:`multigpu.sim.ensemble_store`), and the folder's ``manifest.json`` says what the ensemble is. So the sim
workload decides what an ensemble run continues itself (``Workload.own_progress``: the rank entry point leaves
it to ``main``), by the rule every run resumes by (:func:`multigpu.checkpoint.resume.choose`) applied to
ensemble folders:

* a worker group restarted by torchrun's agent (an elastic job's at every start) continues the run's own
  folder, whatever ``--resume`` said;
* ``--resume auto`` continues the run's own folder (none yet: a new ensemble);
* ``--resume PATH`` continues an ensemble folder (``<run>/ensemble``) or the one in the run folder ``PATH``,
  brought into this run's folder first if it is another run's.

The launcher checks the same before anything starts (:func:`multigpu.sim.job.check`): the folder continued must be
of this run's design (:func:`check_design`) and its files whole (:func:`multigpu.sim.ensemble_store.check_folder`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError

__all__ = ["FOLDER", "MANIFEST", "check_design", "continued", "holds_ensemble", "is_ensemble", "named", "own_folder"]

FOLDER = "ensemble"
"""An ensemble's folder in its run folder."""
MANIFEST = "manifest.json"
"""In an ensemble folder: what the ensemble is (its design), written before any replicate."""


def is_ensemble(path: str | Path | None) -> bool:
    """Whether ``path`` is an ensemble folder (named ``ensemble``, its manifest written)."""
    return path is not None and Path(path).name == FOLDER and (Path(path) / MANIFEST).is_file()


def own_folder(run_dir: str | Path | None) -> Path | None:
    """The ensemble folder of the run folder ``run_dir`` (once its manifest is written), or None."""
    if not run_dir:
        return None
    folder = Path(run_dir) / FOLDER
    return folder if (folder / MANIFEST).is_file() else None


def holds_ensemble(run_dir: Path) -> bool:
    """Whether the run folder ``run_dir`` holds an ensemble to continue (``Workload.own_progress``)."""
    return own_folder(run_dir) is not None


def named(path: str | Path) -> Path | None:
    """The ensemble folder ``--resume PATH`` names: ``PATH`` itself, or the one in the run folder ``PATH``; None:
    neither."""
    path = Path(path)
    if is_ensemble(path):
        return path
    return own_folder(path) if path.name != FOLDER else None


VALID = "auto, or a checkpoints/step_* folder, or a run's ensemble/ folder (or the run folder that holds one)"
"""What ``multigpu sim --resume`` takes."""


def continued(resume: str | None, run_dir: str | Path | None, *, restarts: int | None = None, elastic: bool = False,
              say=print) -> Path | None:
    """The ensemble folder a run continues (see the module docstring), or None: a new ensemble. ``restarts``:
    default the worker group's restart count; ``elastic``: an elastic job's worker group; ``say``: one line about
    the choice. Rank 0 calls it (only rank 0 reads the folder).

    Raises:
        ConfigError: ``PATH`` is not an ensemble folder nor a run folder that holds one.
    """
    from multigpu.runtime.env import restart_count

    restarts = restart_count() if restarts is None else restarts
    own = own_folder(run_dir)
    if (restarts > 0 or elastic) and own is not None:
        say(f"{f'restart {restarts}' if restarts > 0 else 'elastic start'}: continuing {own}")
        return own
    if not resume:
        return None
    if resume == "auto":
        if own is None:
            say("resume=auto: no checkpoint nor ensemble/ folder yet; starting from step 0")
            return None
        say(f"continuing {own}")
        return own
    found = named(resume)
    if found is None:
        raise ConfigError(f"--resume {resume}: not a run's {FOLDER}/ folder, which this sim config continues (an "
                          f"ensemble writes no checkpoints); valid: {VALID}")
    say(f"continuing {found}")
    return found


def check_design(folder: str | Path, design: dict[str, Any]) -> None:
    """A run that continues the ensemble folder ``folder`` must be of the ensemble its ``manifest.json`` describes:
    ``design`` (:func:`multigpu.sim.ensemble.manifest_of` this run's config) compared key by key, the manifest's
    own ``format`` and ``created`` aside. One-line ConfigError naming the first key that differs; the launcher
    calls it for a job before anything starts, and rank 0 again where it opens the folder (a plain script)."""
    path = Path(folder) / MANIFEST
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
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."
