"""Experiment trackers beside the console and ``metrics.jsonl``: TensorBoard and Weights & Biases.

``check_trackers`` runs in the launcher (before anything spawns); the trackers themselves are opened on
rank 0 only, inside the rank, by the trainer (:class:`Trackers`), which hands them every record of its run's step
meter (:mod:`multigpu.monitor.metrics`) with its console line (:func:`console_line`). The ``logger`` config key
names them::

    multigpu train --logger wandb                        # W&B beside metrics.jsonl
    multigpu train logger=tensorboard,wandb wandb.project=mine wandb.mode=offline
    multigpu train logger=[]                             # metrics.jsonl only

The console lines and ``metrics.jsonl`` are always written (resume, ``bench``, ``verify`` and reports
read them); naming ``jsonl`` changes nothing. Left unset, TensorBoard is written when it is installed (the
behaviour before this key existed); named, a tracker that is not installed is an error in the launcher.

Every tracker gets the same records as ``metrics.jsonl`` (the same keys at the same steps), and at the end
the run's summary. W&B also gets the resolved config at start; its files go inside the run directory
(``<run_dir>/wandb/``), the run is named after the run directory, and a resumed run (``--resume``)
continues the same W&B run (its id is kept in ``<run_dir>/wandb/run_id``). A run that fails is finished
with a non-zero exit code, so W&B shows it as failed instead of running forever.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from multigpu.errors import ConfigError

__all__ = ["TRACKERS", "Trackers", "WandbConfig", "check_trackers", "console_line", "open_trackers"]

TRACKERS = ("jsonl", "tensorboard", "wandb")
"""The names the ``logger`` key takes."""
TrackerName = Literal["jsonl", "tensorboard", "wandb"]

_INSTALL = 'pip install "multigpu[tracking]"'


@dataclass(frozen=True, kw_only=True, slots=True)
class WandbConfig:
    """Where ``logger: wandb`` sends the run (the ``wandb.*`` keys); see ``wandb.init``."""

    project: str = "multigpu"
    """The W&B project."""
    name: str | None = None
    """The run's display name; None: the run directory's name."""
    entity: str | None = None
    """The W&B team or user; None: your default entity."""
    mode: Literal["online", "offline", "disabled"] | None = None
    """online, offline (files only; ``wandb sync`` them later) or disabled; None: wandb's own choice
    (``WANDB_MODE``, else online)."""
    dir: str | None = None
    """The folder that gets wandb's ``wandb/`` folder; None: the run directory."""
    tags: list[str] = field(default_factory=list)
    """Tags of the run."""


def selected(logger: list[str] | None) -> list[str]:
    """The optional trackers a ``logger`` value asks for (``jsonl`` is always on)."""
    return [name for name in dict.fromkeys(logger or []) if name != "jsonl"]


def _import(name: str, *, required: bool):
    """The tracker's library, or None when it is not installed and not ``required`` (then: ConfigError)."""
    try:
        if name == "wandb":
            import wandb

            return wandb
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        return SummaryWriter
    except ImportError as exc:
        if not required:
            return None
        package = "wandb" if name == "wandb" else "tensorboard"
        raise ConfigError(f"logger={name} needs the {package} package, which does not import ({exc}); "
                          f"install it with: {_INSTALL} (or pip install {package}), or drop {name} from logger"
                          ) from None


def check_trackers(logger: list[str] | None) -> None:
    """Every tracker named in ``logger`` imports (in the launcher, before ranks spawn). Raises ConfigError."""
    for name in selected(logger):
        _import(name, required=True)


class _TensorBoard:
    def __init__(self, writer_cls, run_dir: Path):
        self.writer = writer_cls(str(run_dir / "tb"))

    def log(self, record: dict[str, Any], unit: str) -> None:
        for key in ("loss", "val_loss", "grad_norm", "lr", f"{unit}_per_s", "comm_share"):
            if record.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", record[key], record["step"])

    def close(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        self.writer.close()


class _Wandb:
    """One W&B run on rank 0: the resolved config at start, every metrics record, the summary at the end."""

    def __init__(self, wandb, cfg: WandbConfig, run_dir: Path | None, config: dict[str, Any], *, fresh: bool):
        id_file = run_dir / "wandb" / "run_id" if run_dir is not None else None
        run_id = None
        if not fresh and id_file is not None and id_file.is_file():  # a resumed run continues its W&B run
            run_id = id_file.read_text().strip() or None
        folder = cfg.dir or (str(run_dir) if run_dir is not None else None)
        # reinit="create_new": a W&B run the user's own script holds stays open
        self.run = wandb.init(
            project=cfg.project, entity=cfg.entity, name=cfg.name or (run_dir.name if run_dir else None),
            dir=folder, config=config, mode=cfg.mode, tags=cfg.tags or None, id=run_id,
            resume="allow" if run_id else None, reinit="create_new",
        )
        if id_file is not None:
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(self.run.id)

    def log(self, record: dict[str, Any], unit: str) -> None:
        values = {k: v for k, v in record.items() if k != "step" and v is not None}
        self.run.log(values, step=record["step"])

    def close(self, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
        if summary:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str, bool))})
        self.run.finish(exit_code=exit_code)


def open_trackers(logger: list[str] | None, run_dir: Path | None, *, wandb: WandbConfig, config: dict[str, Any],
                  fresh: bool) -> list:
    """Open the trackers ``logger`` asks for (call on rank 0 only). None: TensorBoard when it is installed.

    TensorBoard needs a run directory (none: not written); W&B without one uses ``wandb.dir`` or wandb's default.
    """
    if logger is None:
        writer_cls = _import("tensorboard", required=False) if run_dir is not None else None
        return [_TensorBoard(writer_cls, run_dir)] if writer_cls is not None else []
    trackers: list = []
    try:
        for name in selected(logger):
            lib = _import(name, required=True)
            if name == "wandb":
                trackers.append(_Wandb(lib, wandb, run_dir, config, fresh=fresh))
            elif run_dir is not None:
                trackers.append(_TensorBoard(lib, run_dir))
    except BaseException:
        close_all(trackers, exit_code=1)  # the ones already open do not stay open
        raise
    return trackers


def close_all(trackers: list, summary: dict[str, Any] | None = None, exit_code: int = 0) -> None:
    """Close every tracker; one that fails to close does not keep the others open."""
    for tracker in trackers:
        try:
            tracker.close(summary, exit_code)
        except Exception as exc:  # noqa: BLE001 - a tracker's own failure must not hide the run's result
            print(f"warning: closing {type(tracker).__name__.strip('_')} failed: {exc}", file=sys.stderr, flush=True)


class Trackers:
    """A run's open trackers (rank 0's; none on the other ranks): each gets every record, and they are closed once,
    with the run's exit code."""

    def __init__(self, trackers: list, unit: str):
        self.trackers, self.unit = trackers, unit

    def log(self, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.log(record, self.unit)

    @contextlib.contextmanager
    def closed_on_error(self) -> Iterator[None]:
        """Around the training loop: an exception (or Ctrl-C) closes the trackers as failed, then goes on."""
        try:
            yield
        except BaseException as exc:
            self.close(exit_code=130 if isinstance(exc, KeyboardInterrupt) else 1)
            raise

    def close(self, summary: dict[str, Any] | None = None, *, exit_code: int = 0) -> None:
        """Close the trackers (with the run's summary); closing again does nothing."""
        trackers, self.trackers = self.trackers, []
        close_all(trackers, summary, exit_code)


def console_line(record: dict[str, Any], total_steps: int, unit: str) -> str:
    """A training record as rank 0 prints it: ``step 10/100 | loss 2.3412 | grad_norm 0.812 | lr 0.0003 |
    41,503 tokens/s | comm 12%`` (``val_loss`` where it was measured; ``comm n/a (not measured)`` where nobody
    could time the communication)."""
    parts = [f"step {record['step']}/{total_steps}", f"loss {record['loss']:.4f}"]
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    parts += [f"grad_norm {record['grad_norm']:.3f}", f"lr {record['lr']:.3g}"]
    rate = record.get(f"{unit}_per_s")
    if rate:
        parts.append(f"{rate:,.0f} {unit}/s")
    share = record["comm_share"]
    parts.append(f"comm {100 * share:.0f}%" if share is not None else "comm n/a (not measured)")
    return " | ".join(parts)
