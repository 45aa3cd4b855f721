"""Checkpoints of every workload: one store, one layout, resume decided once (inside each rank).

* :mod:`~multigpu.checkpoint.store`: :class:`CheckpointStore` writes and reads ``step_*/`` folders;
* :mod:`~multigpu.checkpoint.resume`: :func:`resolve` turns ``--resume`` and a restart into the run
  context's ``resume_from`` (the rank entry point calls it once);
* :mod:`~multigpu.checkpoint.files`: atomic, checksummed writes and the errors;
* :mod:`~multigpu.checkpoint.dcp_safe`: DCP folders read without unpickling anything but DCP's metadata;
* :mod:`~multigpu.checkpoint.rng`: the random state as a part.
"""

from multigpu.checkpoint.files import CheckpointError, CheckpointWriteError, CorruptCheckpointError
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

__all__ = ["CHECKPOINTS", "MANIFEST", "STATE", "CheckpointError", "CheckpointStore", "CheckpointWriteError",
           "CorruptCheckpointError", "OldLayoutError", "PerRank", "RngState", "Sharded", "check_resume_path",
           "choose", "is_checkpoint", "read_manifest", "resolve", "restart_count", "verify"]
