"""Data-parallel training (inside each rank): the Trainer, its config, checkpoints, and the nano GPT.

    import multigpu as mg
    from multigpu.train import Trainer, TrainConfig

    mg.init(seed=0)
    trainer = Trainer(model, optimizer, train_set, config=TrainConfig(steps=100), val_data=val_set)
    trainer.fit()
    trainer.close()

``multigpu train`` runs the built-in character-level GPT, or your model and
data (factories), through the launcher: see :mod:`multigpu.train.job`.
"""

from multigpu.train.checkpoint import CheckpointManager, find_latest
from multigpu.train.config import TrainConfig
from multigpu.train.nano import DataConfig, ModelConfig
from multigpu.train.optim import make_optimizer, make_scheduler
from multigpu.train.trainer import Trainer, default_loss

__all__ = [
    "CheckpointManager",
    "DataConfig",
    "ModelConfig",
    "TrainConfig",
    "Trainer",
    "default_loss",
    "find_latest",
    "make_optimizer",
    "make_scheduler",
]
