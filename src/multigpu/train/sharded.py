"""Sharded checkpoints of ``strategy: fsdp`` with ``torch.distributed.checkpoint`` (inside each rank).

Each rank writes its own shard of the model and of the optimizer state; a run
saved on N ranks resumes on any number of ranks (DCP reshards on load)::

    checkpoints/step_00000006/
        .metadata, __0_0.distcp, __1_0.distcp   # DCP: tensors only (model, optimizer state)
        trainer.pt        # rank 0: step, scheduler, scaler, sampler, optimizer param_groups, every rank's RNG
        manifest.json     # size and SHA-256 of each file above (each rank hashes the files it wrote)

A checkpoint is written to ``step_<n>.tmp`` and renamed when complete, so a
folder without ``manifest.json`` is never looked at. Loading verifies every file
against ``manifest.json`` first (:func:`check_checkpoint`, bytes only: the
launcher runs it for ``--resume DIR``), then reads DCP's ``.metadata`` (a
pickle) with the restricted unpickler shared with the simulation checkpoints
(:mod:`multigpu.dcp_safe`: DCP's metadata classes only, tensor entries
only, files of this folder only; torch never unpickles it), the tensor files
with ``weights_only=True``, and ``trainer.pt`` with ``torch.load(weights_only=True)``.
The checksums show that a checkpoint is the one a run wrote, not who wrote it:
resume only from checkpoints from a trusted source.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

import multigpu as mg
from multigpu.checkpointing import (
    CheckpointWriteError,
    CorruptCheckpointError,
    atomic_write,
    fsync_dir,
    sha256_file,
)
from multigpu.train.checkpoint import agree_on_choice, checked_choice

__all__ = ["ShardedCheckpoints", "check_checkpoint", "is_sharded_checkpoint", "load_tensors"]

_PREFIX = "step_"
_MANIFEST = "manifest.json"
_TRAINER = "trainer.pt"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A folder written by :class:`ShardedCheckpoints` (it has a manifest.json)."""
    return Path(path).is_dir() and (Path(path) / _MANIFEST).is_file()


def check_checkpoint(directory: str | Path) -> dict[str, Any]:
    """The manifest of ``directory`` once every file it lists has the recorded size and SHA-256.

    Reads bytes only (nothing is unpickled); local, no communication.

    Raises:
        CorruptCheckpointError: naming the folder and what is wrong.
    """
    directory = Path(directory)
    try:
        files = json.loads((directory / _MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise CorruptCheckpointError(directory, f"it is not a sharded checkpoint (no {_MANIFEST})") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(directory, f"its {_MANIFEST} cannot be read ({type(exc).__name__})") from None
    for name in (".metadata", _TRAINER):
        if name not in files:
            raise CorruptCheckpointError(directory, f"its {_MANIFEST} records no checksum of {name}")
    for name, entry in files.items():
        path = directory / name
        if Path(name).name != name or not path.is_file():
            raise CorruptCheckpointError(directory, f"{name} is missing")
        if sha256_file(path) != (entry["bytes"], entry["sha256"]):
            raise CorruptCheckpointError(directory, f"{name} does not match {_MANIFEST} (truncated, altered or "
                                                    "damaged after it was saved)")
    return files


def _load_trainer_file(path: Path) -> dict[str, Any]:
    from multigpu.train.checkpoint import _legacy_numpy_globals

    try:
        with torch.serialization.safe_globals(_legacy_numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - refused by the weights-only unpickler, or unreadable
        raise CorruptCheckpointError(path, f"it does not load with weights_only=True ({type(exc).__name__})") from None


@contextlib.contextmanager
def _quiet():
    """DCP in one process warns that it "assumes the intent" to save or load locally: it is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class ShardedCheckpoints:
    """Saves and finds ``step_<n>`` checkpoint folders in ``directory``, keeping the newest ``keep_last``."""

    def __init__(self, directory: str | Path, keep_last: int = 3):
        self.directory = Path(directory)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.directory / f"{_PREFIX}{step:08d}"

    def _folders(self) -> list[Path]:
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.glob(f"{_PREFIX}*") if p.is_dir() and p.name[len(_PREFIX):].isdigit()]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))

    # ------------------------------------------------------------------ saving
    def save(self, trainer_state: dict[str, Any], module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Path:
        """Write checkpoint ``trainer_state["step"]``: each rank its shards, rank 0 the rest. Call on all ranks.

        Raises:
            CheckpointWriteError: on every rank, when a rank could not write (e.g. disk full).
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from multigpu.train.checkpoint import capture_rng

        final = self.path_for(int(trainer_state["step"]))
        tmp = final.with_name(final.name + ".tmp")
        if mg.is_main():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        mg.barrier()
        model_sd, optim_sd = get_state_dict(module, optimizer)
        failure, mine = None, {}
        try:
            with _quiet():
                dcp.save({"model": model_sd, "optim": optim_sd["state"]}, checkpoint_id=str(tmp))
            names = [p for p in tmp.glob(f"__{mg.rank()}_*.distcp")] + ([tmp / ".metadata"] if mg.is_main() else [])
            mine = {p.name: dict(zip(("bytes", "sha256"), sha256_file(p), strict=True)) for p in names}
        except OSError as exc:
            failure = f"rank {mg.rank()} could not write checkpoint {final}: {exc}"
        rngs = mg.gather(capture_rng(), dst=0)
        parts = mg.gather({"files": mine, "failure": failure}, dst=0)  # one dict per rank
        if mg.is_main():
            failure = next((p["failure"] for p in parts if p["failure"]), None)
            if failure is None:
                failure = self._finish(tmp, final, {**trainer_state, "param_groups": optim_sd["param_groups"],
                                                    "rng": rngs, "world_size": mg.world_size()}, parts)
        failure = mg.broadcast_object(failure)
        if failure is not None:
            raise CheckpointWriteError(failure)
        return final

    def _finish(self, tmp: Path, final: Path, state: dict, parts: list) -> str | None:
        """Rank 0: trainer.pt, the manifest, the rename, pruning. Returns what failed, or None."""
        try:
            size, digest = atomic_write(tmp / _TRAINER, lambda fh: torch.save(state, fh))
            files = {_TRAINER: {"bytes": size, "sha256": digest}}
            for part in parts:
                files.update(part["files"])
            text = json.dumps({"format": 1, "step": state["step"], "world_size": state["world_size"],
                               "files": files}, indent=2).encode()
            atomic_write(tmp / _MANIFEST, lambda fh: fh.write(text))
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            fsync_dir(self.directory)
        except OSError as exc:
            return f"could not write checkpoint {final}: {exc}"
        for old in self._folders()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        return None

    # ------------------------------------------------------------------ loading
    def resolve(self, resume: str) -> Path | None:
        """The folder ``resume`` names ("auto": the newest valid one here, or None). Rank 0 decides. Call on all ranks."""
        choice = error = None
        if mg.is_main():
            if resume == "auto":
                for path in reversed(self._folders()):
                    if not (path / _MANIFEST).is_file():
                        continue
                    try:
                        check_checkpoint(path)
                        choice = str(path)
                        break
                    except CorruptCheckpointError as exc:
                        mg.get_logger().warning(f"skipping {exc}")
            elif not is_sharded_checkpoint(resume):
                error = ("config", f"resume={resume!r}: not a sharded checkpoint folder (strategy=fsdp writes "
                                   "checkpoints/step_*/); valid: auto, or such a folder")
            else:
                choice, error = checked_choice(resume, check_checkpoint)
        return agree_on_choice(choice, error)

    def load(self, path: Path) -> dict[str, Any]:
        """``trainer.pt`` of ``path`` (verified by :meth:`resolve`), with ``sharded_dir`` set to ``path``."""
        state = _load_trainer_file(Path(path) / _TRAINER)
        return {**state, "sharded_dir": str(path)}


def load_tensors(path: Path, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 param_groups: list) -> None:
    """Fill ``module`` and ``optimizer`` (sharded or not) from ``path``, resharded to this job. Call on all ranks."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from multigpu import dcp_safe

    path = Path(path)
    metadata = dcp_safe.read_metadata(path)  # before anything is built: a refused file changes nothing
    model_sd, optim_sd = get_state_dict(module, optimizer)  # this job's layout; initializes the optimizer state
    dcp_safe.load({"model": model_sd, "optim": optim_sd["state"]}, path, metadata)
    set_state_dict(module, optimizer, model_state_dict=model_sd,
                   optim_state_dict={"state": optim_sd["state"], "param_groups": param_groups})
