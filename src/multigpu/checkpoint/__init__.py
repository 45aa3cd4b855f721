"""Checkpoints of every workload: one store, one layout, resume decided once (inside each rank).

* :mod:`~multigpu.checkpoint.store`: :class:`CheckpointStore` writes and reads ``step_*/`` folders;
* :mod:`~multigpu.checkpoint.resume`: :func:`decide` turns ``--resume`` and a restart into the run
  context's ``resume_from``, once (the rank entry point for a job, the run harness for a plain script);
* :mod:`~multigpu.checkpoint.checkpointer`: :class:`Checkpointer`, a run's store with its cadence and its
  background writer (staging in :mod:`~multigpu.checkpoint.staging`);
* :mod:`~multigpu.checkpoint.files`: atomic, checksummed writes (the errors are :mod:`multigpu.errors`'s);
* :mod:`~multigpu.checkpoint.dcp_safe`: DCP folders read without unpickling anything but DCP's metadata;
* :mod:`~multigpu.checkpoint.rng`: the random state as a part.
"""

from multigpu.checkpoint.checkpointer import MODES, Checkpointer
from multigpu.checkpoint.resume import CHECKPOINTS, check_resume_path, choose, decide, resolve, restart_count
from multigpu.checkpoint.rng import RngState
from multigpu.checkpoint.store import (
    MANIFEST,
    STATE,
    CheckpointStore,
    PerRank,
    Sharded,
    is_checkpoint,
    read_manifest,
    verify,
)
from multigpu.errors import CheckpointError, CheckpointWriteError, CorruptCheckpointError, OldLayoutError

__all__ = ["CHECKPOINTS", "MANIFEST", "MODES", "STATE", "CheckpointError", "CheckpointStore", "CheckpointWriteError",
           "Checkpointer", "CorruptCheckpointError", "OldLayoutError", "PerRank", "RngState", "Sharded",
           "check_resume_path", "choose", "decide", "is_checkpoint", "read_manifest", "resolve", "restart_count", "verify"]
