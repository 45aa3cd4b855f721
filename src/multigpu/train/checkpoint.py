"""Checkpoints of a training run: rank 0 writes atomically with a checksum, every rank loads the same valid one.

Runs inside each rank. A checkpoint is one ``torch.save`` file
``<dir>/ckpt_<step:08d>.pt`` holding everything a run needs to continue exactly
where it stopped: model, optimizer, scheduler, grad scaler, sampler position,
step, and the random state of *every* rank (gathered to rank 0; each rank's own GPU's,
:mod:`multigpu.runtime.rng`). The file
handling is :class:`multigpu.checkpointing.CheckpointFolder`: temporary file,
fsync, rename, fsync of the folder, SHA-256 and size in ``manifest.json``.

* A failed save (a full disk) raises :class:`CheckpointWriteError` on *every*
  rank (rank 0 tells the others), naming the file, the reason and the previous
  checkpoint, which is intact. Training stops there: going on without being
  able to save would risk losing everything after the last good checkpoint,
  silently. Free some space and continue with ``resume=auto``.
* ``resume="auto"`` takes the newest checkpoint whose size and SHA-256 match
  the manifest and that loads; each one skipped is named in a warning with what
  is wrong (truncated, checksum mismatch, does not load).
* ``resume=<path>`` must be valid itself: a damaged file is an error that says
  what is wrong (no silent fallback from a file the user chose).
* Before anything is loaded into the model, the checkpoint's parameter names
  and shapes are compared with the model's (:func:`check_model_fits`): a
  checkpoint of another model is one line naming the first difference and the
  model settings that differ, not ``load_state_dict``'s page of size mismatches.
  The manifest entry records the shapes too (``params``), so the launcher makes
  the same comparison before anything starts, without opening the file
  (:func:`recorded_params`).

Loading runs no code from the file. A checkpoint is loaded only if its folder's
``manifest.json`` records its size and SHA-256 and the file matches them (a
file the manifest does not list is never loaded), and then with
``torch.load(weights_only=True)``: tensors, numbers, strings, lists, tuples and
dicts, nothing else. What is saved is made of those alone (the NumPy random
state is stored as a tensor). A file holding anything else (a pickled
function call, a custom class in a user's optimizer or scheduler state) is
refused with one line naming the file and the object.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import multigpu as mg
from multigpu.checkpointing import (
    CheckpointFolder,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from multigpu.errors import ConfigError
from multigpu.runtime.rng import capture_rng, restore_rng  # re-exported: checkpoints store and restore them

__all__ = [
    "CheckpointManager",
    "CheckpointWriteError",
    "CorruptCheckpointError",
    "capture_rng",
    "check_checkpoint",
    "check_model_fits",
    "check_resume_fits",
    "find_latest",
    "recorded_params",
    "restore_rng",
]

_REQUIRED = ("step", "model", "optimizer", "rng")


def _legacy_numpy_globals() -> list:
    """What a NumPy RNG state needs under weights_only: checkpoints written before it was stored as a tensor.

    Allowed for the duration of one load only (never process-wide): an ndarray of plain numbers.
    """
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
    return [np.ndarray, np.dtype, core.multiarray._reconstruct, type(np.dtype(np.uint32))]


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _refused(exc: pickle.UnpicklingError) -> str:
    """One line for what torch's weights-only unpickler refused (its own message is a page long)."""
    text = str(exc)
    found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"unrecognized function (\S+)", text)
    if found:
        return (f"it refers to {found[1]}, which is not a tensor or plain value; checkpoints are loaded with "
                "weights_only=True, so it was not loaded and nothing in it ran")
    detail = re.search(r"WeightsUnpickler error:\s*(\S.*)", text)
    return f"it does not load with weights_only=True ({detail[1].strip() if detail else _first_line(exc)})"


def _load(path: Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``: tensors and plain values only, nothing in the file runs."""
    allow = getattr(torch.serialization, "safe_globals", None)  # torch >= 2.5; scoped to this one load
    try:
        if allow is not None:
            with allow(_legacy_numpy_globals()):
                state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CorruptCheckpointError(path, _refused(exc)) from None
    except Exception as exc:  # noqa: BLE001 - any other failure to read it means the file is unusable
        raise CorruptCheckpointError(path, f"it does not load ({_first_line(exc)})") from None
    if not isinstance(state, dict) or any(k not in state for k in _REQUIRED):
        raise CorruptCheckpointError(path, f"it is not a multigpu checkpoint (it lacks {', '.join(_REQUIRED)})")
    return state


def _folder(directory: str | Path, keep_last: int = 3) -> CheckpointFolder:
    return CheckpointFolder(directory, keep_last, warn=lambda msg: mg.get_logger().warning(msg))


def check_checkpoint(path: str | Path) -> None:
    """Raise :class:`CorruptCheckpointError` (naming the file and what is wrong) unless ``path`` is usable.

    Its folder's manifest must list it, and it must have the recorded size and
    SHA-256. Only its bytes are read: it is not unpickled (the launcher calls
    this). A file the manifest does not list, or one with no manifest beside it,
    is refused. Local; no communication.
    """
    path = Path(path)
    _folder(path.parent).verify(path)


def _settings_differ(saved: Any, current: Any, prefix: str = "") -> list[str]:
    """``model.n_embd 64 -> 32``: the config entries (nested dicts) whose values differ; only the ``model``
    part when both configs have one (steps or checkpoint_every may change on a resume)."""
    if not prefix and isinstance(saved, dict) and isinstance(current, dict) and "model" in saved and "model" in current:
        return _settings_differ(saved["model"], current["model"], "model.")
    if isinstance(saved, dict) and isinstance(current, dict):
        return [d for k in sorted(set(saved) & set(current), key=str)
                for d in _settings_differ(saved[k], current[k], f"{prefix}{k}.")]
    return [] if saved == current else [f"{prefix.rstrip('.')} {saved!r} -> {current!r}"]


def param_shapes(state_dict: dict[str, Any]) -> dict[str, list[int]]:
    """Name -> shape of every tensor in a state dict (what a manifest entry records as ``params``)."""
    return {k: list(v.shape) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def shape_mismatch(saved: dict[str, Any], own: dict[str, Any]) -> str | None:
    """The first difference between two ``name -> shape`` maps, with a count of the others; None if they match."""
    shapes = [(k, tuple(saved[k]), tuple(v)) for k, v in own.items() if k in saved and tuple(saved[k]) != tuple(v)]
    missing = [k for k in own if k not in saved]
    unexpected = [k for k in saved if k not in own]
    count = len(shapes) + len(missing) + len(unexpected)
    if not count:
        return None
    if shapes:
        first = f"{shapes[0][0]} is {shapes[0][1]} in the checkpoint and {shapes[0][2]} in the model"
    elif missing:
        first = f"the model's {missing[0]} is not in the checkpoint"
    else:
        first = f"the checkpoint's {unexpected[0]} is not in the model"
    return first + (f" (and {count - 1} more difference(s))" if count > 1 else "")


def _does_not_fit(path: str | Path, mismatch: str, differ: list[str]) -> ConfigError:
    settings = f" ({', '.join(differ[:4])}: the checkpoint's settings -> this run's)" if differ else ""
    return ConfigError(f"checkpoint {path} does not fit this model: {mismatch}; valid: resume with the model "
                       f"settings it was written with{settings}, or start without --resume in a new --run-dir")


def check_model_fits(path: str | Path, state: dict[str, Any], model: torch.nn.Module,
                     config: dict[str, Any] | None = None) -> None:
    """Raise a one-line ConfigError unless the checkpoint's parameters match ``model``'s by name and shape.

    Args:
        path: The checkpoint, for the message.
        state: What :meth:`CheckpointManager.load` returned (``state["model"]`` is compared).
        model: The model about to receive it.
        config: This run's config as a dict; the message names the model settings that differ from the
            checkpoint's own ``config`` (what the run that wrote it used).
    """
    saved = state.get("model")
    if not isinstance(saved, dict):
        raise CorruptCheckpointError(path, "its 'model' entry is not a state dict")
    mismatch = shape_mismatch(param_shapes(saved), param_shapes(model.state_dict()))
    if mismatch is not None:
        raise _does_not_fit(path, mismatch, _settings_differ(state.get("config"), config) if config else [])


def recorded_params(path: str | Path) -> dict[str, list[int]] | None:
    """The parameter shapes the manifest records for checkpoint ``path`` (None: not recorded). Reads only
    the manifest, never the checkpoint (the launcher calls this)."""
    path = Path(path)
    entry = _folder(path.parent).manifest().get(path.name) or {}
    params = entry.get("params")
    return params if isinstance(params, dict) else None


def check_resume_fits(path: str | Path, model: torch.nn.Module, config: dict[str, Any] | None = None,
                      written_by: dict[str, Any] | None = None) -> None:
    """In the launcher: the shapes ``path``'s manifest entry records must be ``model``'s (a meta-device model
    will do). One-line ConfigError otherwise; nothing is checked for a checkpoint that records none.

    ``written_by``: the config of the run that wrote it (its run.json), to name the settings that differ.
    """
    saved = recorded_params(path)
    if saved is None:
        return
    mismatch = shape_mismatch(saved, param_shapes(model.state_dict()))
    if mismatch is not None:
        raise _does_not_fit(path, mismatch, _settings_differ(written_by, config) if written_by and config else [])


def find_latest(directory: str | Path) -> Path | None:
    """The newest usable checkpoint in ``directory``, or None (local; no communication). Skips are warned."""
    return _folder(directory).latest_valid(check=_load)


class CheckpointManager:
    """Saves and finds checkpoints in ``directory``, keeping the newest ``keep_last``."""

    def __init__(self, directory: str | Path, keep_last: int = 3):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.folder = _folder(self.directory, keep_last)

    def path_for(self, step: int) -> Path:
        return self.folder.path_for(step)

    def save(self, state: dict[str, Any]) -> Path:
        """Write ``state`` (plus every rank's RNG state) as ``ckpt_<step>``. Call on all ranks.

        ``state`` must be the same on every rank except for what differs per rank
        (only the RNG state, which this adds); rank 0's copy is written.

        Raises:
            CheckpointWriteError: on every rank, when rank 0 could not write (e.g. disk full).
        """
        rngs = mg.gather(capture_rng(), dst=0)
        path = self.path_for(int(state["step"]))
        failure = None
        if mg.is_main():
            full = {**state, "rng": rngs, "world_size": mg.world_size()}
            try:
                self.folder.save(int(state["step"]), lambda fh: torch.save(full, fh),
                                 meta={"params": param_shapes(state["model"])})
            except CheckpointWriteError as exc:
                failure = str(exc)
        # a sync point: no rank goes on (or exits) before the file is in place, and all learn whether it is
        failure = mg.broadcast_object(failure)
        if failure is not None:
            raise CheckpointWriteError(failure)
        return path

    def resolve(self, resume: str) -> Path | None:
        """The file ``resume`` names: "auto" = newest valid here (None if there is none), else a path.

        Rank 0 decides and tells the others, so all ranks load the same file. Call on all ranks.

        Raises:
            ConfigError: ``resume`` is a path that does not exist.
            CorruptCheckpointError: ``resume`` is a path to a damaged checkpoint (on every rank).
        """
        choice = error = None
        if mg.is_main():
            if resume == "auto":
                found = find_latest(self.directory)
                choice = str(found) if found else None
            elif not Path(resume).is_file():
                error = ("config", f"resume={resume!r}: no such checkpoint file; valid: auto, "
                                   "or the path of a ckpt_*.pt")
            else:
                choice, error = checked_choice(resume, check_checkpoint)
        return agree_on_choice(choice, error)

    def load(self, path: Path) -> dict[str, Any]:
        """Load ``path`` on this rank (to CPU); the caller restores each part."""
        return _load(path)


def checked_choice(resume: str, check: Callable[[str], Any]) -> tuple[str | None, tuple | None]:
    """``(resume, None)`` when ``check(resume)`` passes, else ``(None, ("corrupt", (path, reason)))``: what
    :func:`agree_on_choice` takes. Rank 0 only (the checks read files, they load nothing)."""
    try:
        check(resume)
        return resume, None
    except CorruptCheckpointError as exc:
        return None, ("corrupt", (str(exc.path), exc.reason))


def agree_on_choice(choice: str | None, error: tuple | None) -> Path | None:
    """Rank 0's resume choice (or its one-line error) on every rank: ``error`` is ("config", message) or
    ("corrupt", (path, reason)). Call on all ranks."""
    choice, error = mg.broadcast_object((choice, error))
    if error is not None:
        kind, detail = error
        raise ConfigError(detail) if kind == "config" else CorruptCheckpointError(*detail)
    return Path(choice) if choice else None
