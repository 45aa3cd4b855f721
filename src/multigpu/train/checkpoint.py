"""Checkpoints: rank 0 writes atomically, the others wait; keep the last K; find the newest valid one.

Runs inside each rank. A checkpoint is one ``torch.save`` file
``<dir>/ckpt_<step:08d>.pt`` holding everything a run needs to continue exactly
where it stopped: model, optimizer, scheduler, grad scaler, sampler position,
step, and the random state of *every* rank (gathered to rank 0). Rank 0 writes
it to a temporary file in the same folder, flushes and fsyncs it, then renames
it into place, so a reader never sees half a checkpoint; the other ranks wait
at a barrier until it is there. ``find_latest`` skips files that do not load
(a crash mid-write leaves only a ``.tmp`` file, which it ignores anyway).
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import torch

import multigpu as mg
from multigpu.errors import ConfigError

__all__ = ["CheckpointManager", "capture_rng", "find_latest", "restore_rng"]

_NAME = re.compile(r"^ckpt_(\d{8})\.pt$")
_REQUIRED = ("step", "model", "optimizer", "rng")


def capture_rng() -> dict[str, Any]:
    """This process's random state: Python, NumPy, torch CPU and (if present) CUDA."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back a state from :func:`capture_rng`."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _checkpoints(directory: Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest step first."""
    if not directory.is_dir():
        return []
    return sorted((p for p in directory.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)


def _load(path: Path) -> dict[str, Any]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if not isinstance(state, dict) or any(k not in state for k in _REQUIRED):
        raise ValueError(f"{path} is not a multigpu checkpoint (missing {', '.join(_REQUIRED)})")
    return state


def find_latest(directory: str | Path) -> Path | None:
    """The newest checkpoint in ``directory`` that loads, or None (local; no communication)."""
    for path in reversed(_checkpoints(Path(directory))):
        try:
            _load(path)
            return path
        except Exception as exc:  # noqa: BLE001 - a damaged file is skipped, with a warning
            mg.get_logger().warning(f"skipping checkpoint {path.name}: it does not load ({type(exc).__name__}: {exc})")
    return None


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves and finds checkpoints in ``directory``, keeping the newest ``keep_last``."""

    def __init__(self, directory: str | Path, keep_last: int = 3):
        self.directory = Path(directory)
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt_{step:08d}.pt"

    def save(self, state: dict[str, Any]) -> Path:
        """Write ``state`` (plus every rank's RNG state) as ``ckpt_<step>``. Call on all ranks.

        ``state`` must be the same on every rank except for what differs per rank
        (only the RNG state, which this adds); rank 0's copy is written.
        """
        rngs = mg.gather(capture_rng(), dst=0)
        path = self.path_for(int(state["step"]))
        if mg.is_main():
            self._write_atomic(path, {**state, "rng": rngs, "world_size": mg.world_size()})
            self._prune()
        mg.barrier()  # no rank goes on (or exits) before the file is in place
        return path

    def _write_atomic(self, path: Path, state: dict[str, Any]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(self.directory)

    def _prune(self) -> None:
        for old in _checkpoints(self.directory)[: -self.keep_last]:
            old.unlink(missing_ok=True)

    def resolve(self, resume: str) -> Path | None:
        """The file ``resume`` names: "auto" = newest valid here (None if there is none), else a path.

        Rank 0 decides and tells the others, so all ranks load the same file. Call on all ranks.
        """
        if mg.is_main():
            if resume == "auto":
                found: Path | None = find_latest(self.directory)
            else:
                found = Path(resume)
                if not found.is_file():
                    found = None
            choice = str(found) if found else None
        else:
            choice = None
        choice = mg.broadcast_object(choice)
        if resume != "auto" and choice is None:
            raise ConfigError(f"resume={resume!r}: no such checkpoint file; valid: auto, or the path of a ckpt_*.pt")
        return Path(choice) if choice else None

    def load(self, path: Path) -> dict[str, Any]:
        """Load ``path`` on this rank (to CPU); the caller restores each part."""
        return _load(path)
