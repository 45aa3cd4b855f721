"""Data-parallel training (inside each rank): the Trainer, its config, checkpoints, and the nano GPT.

    import multigpu as mg
    from multigpu.train import Trainer, TrainConfig

    mg.init(seed=0)
    trainer = Trainer(model, optimizer, train_set, config=TrainConfig(steps=100), val_data=val_set)
    trainer.fit()
    trainer.close()

``multigpu train`` runs the built-in character-level GPT, or your model and
data (factories), through the launcher: see :mod:`multigpu.train.job`.

The names below are imported on first use: the launcher imports
``multigpu.train.job`` (hence this package) to check a job before spawning,
and needs none of the Trainer's modules (trainer, loader, monitor, ...) for it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "TrainConfig": "multigpu.train.config",
    "DataConfig": "multigpu.train.nano",
    "ModelConfig": "multigpu.train.nano",
    "make_optimizer": "multigpu.train.optim",
    "make_scheduler": "multigpu.train.optim",
    "Trainer": "multigpu.train.trainer",
    "default_loss": "multigpu.train.trainer",
}
"""Public name -> the module that defines it."""

__all__ = [
    "DataConfig",
    "ModelConfig",
    "TrainConfig",
    "Trainer",
    "default_loss",
    "make_optimizer",
    "make_scheduler",
]

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports them
    from multigpu.train.config import TrainConfig
    from multigpu.train.nano import DataConfig, ModelConfig
    from multigpu.train.optim import make_optimizer, make_scheduler
    from multigpu.train.trainer import Trainer, default_loss


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value  # once: later lookups do not come here
        return value
    raise AttributeError(f"module 'multigpu.train' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
