"""Checkpoints of every workload: one store, one layout, resume decided once (inside each rank).

:class:`CheckpointStore` writes and reads ``step_*/`` folders (see :mod:`multigpu.checkpoint.store`);
:func:`choose` turns ``--resume`` and a restart into the run context's ``resume_from``
(:mod:`multigpu.checkpoint.resume`).
"""

from multigpu.checkpoint.resume import CHECKPOINTS, check_resume_path, choose, resolve, restart_count
from multigpu.checkpoint.rng import RngState
from multigpu.checkpoint.store import (
    MANIFEST,
    STATE,
    CheckpointStore,
    OldLayoutError,
    PerRank,
    Sharded,
    is_checkpoint,
    read_manifest,
    verify,
)
from multigpu.checkpointing import CheckpointError, CheckpointWriteError, CorruptCheckpointError

__all__ = ["CHECKPOINTS", "MANIFEST", "STATE", "CheckpointError", "CheckpointStore", "CheckpointWriteError",
           "CorruptCheckpointError", "OldLayoutError", "PerRank", "RngState", "Sharded", "check_resume_path",
           "choose", "is_checkpoint", "read_manifest", "resolve", "restart_count", "verify"]
