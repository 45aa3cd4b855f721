"""What a training checkpoint holds beyond tensors: the random state, and whether it fits the model.

Runs inside each rank (``check_resume_fits`` in the launcher). The checkpoints themselves are
:class:`multigpu.checkpoint.CheckpointStore`'s ``step_*`` folders (the trainer names the parts: model,
optimizer, trainer state, every rank's random state); this module keeps what is training's own:

* :func:`capture_rng` / :func:`restore_rng` (from :mod:`multigpu.runtime.rng`): this process's random state,
  its own GPU's only, as tensors and plain values (``torch.load(weights_only=True)`` reads it back);
* before anything is loaded into the model, the checkpoint's parameter names and shapes are compared
  with the model's (:func:`check_model_fits`): a checkpoint of another model is one line naming the
  first difference and the model settings that differ, not ``load_state_dict``'s page of size
  mismatches. The manifest records the shapes too (``meta.params``), so the launcher makes the same
  comparison before anything starts, without opening a file (:func:`recorded_params`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from multigpu.errors import ConfigError, CorruptCheckpointError
from multigpu.runtime.rng import capture_rng, restore_rng  # re-exported: checkpoints store and restore them

__all__ = [
    "capture_rng",
    "check_model_fits",
    "check_layout",
    "check_resume_fits",
    "is_sharded",
    "recorded_params",
    "restore_rng",
]


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
        state: The checkpoint's parts (``state["model"]``, a state dict, is compared).
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
    """The parameter shapes the manifest of checkpoint folder ``path`` records (None: not recorded). Reads only
    the manifest, never a checkpoint file (the launcher calls this)."""
    from multigpu.checkpoint import read_manifest

    try:
        params = (read_manifest(path).get("meta") or {}).get("params")
    except CorruptCheckpointError:
        return None
    return params if isinstance(params, dict) else None


def is_sharded(path: str | Path) -> bool:
    """Whether checkpoint folder ``path`` holds its tensors as DCP shards (written under fsdp or hsdp), read from its
    manifest (the launcher calls this too: nothing is unpickled). Those load into any layout, ddp's whole model
    included (DCP reshards); whole state dicts (ddp's) load only into a whole model.
    """
    from multigpu.checkpoint import read_manifest

    return ".metadata" in read_manifest(path)["files"]


def check_layout(path: str | Path, strategy: str) -> bool:
    """:func:`is_sharded`, refusing in one line a checkpoint of whole state dicts under a sharded strategy."""
    sharded = is_sharded(path)
    if not sharded and strategy != "ddp":
        raise ConfigError(f"checkpoint {path} holds whole state dicts (written under strategy=ddp), which "
                          f"strategy={strategy} does not load; valid: resume it with strategy=ddp")
    return sharded


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
