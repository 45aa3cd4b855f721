"""Fault injection for tests (inside each rank): a rank kills itself at a chosen step, once.

A test registers the fault as a callback of the workload, through a tiny module
of its own, so that no production code path reads a fault setting::

    # tmp/fault_here.py
    from multigpu.testing.faults import KillAt
    def hook():
        return KillAt(rank=1, step=7)

    PYTHONPATH=tmp multigpu train ... callbacks=[fault_here:hook] --max-restarts 1
    # rank 1 sends itself SIGKILL right after optimizer step 7, on the first attempt only

The kill fires only on the first attempt (``restart_count() == 0``), so the
restarted worker group (which resumes from the newest valid checkpoint) runs
to the end.
"""

from __future__ import annotations

import os
import signal

from multigpu.checkpoint.resume import restart_count
from multigpu.runtime import group

__all__ = ["KillAt", "kill_self"]


class KillAt:
    """A callback (``on_step``) that SIGKILLs rank ``rank`` after step ``step`` of the first attempt.

    Works with the Trainer (its ``step``), the simulation engine (its ``step_index``), PPO (updates done) and a
    simulation ensemble (waves done).
    """

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step
        self.armed = restart_count() == 0

    def on_step(self, owner) -> None:
        step = getattr(owner, "step_index", None)
        if step is None:
            step = owner.step
        if self.armed and step == self.step and group.rank() == self.rank:
            kill_self()


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no flush, as a crashed machine or the OOM killer would end it."""
    os.kill(os.getpid(), signal.SIGKILL)
