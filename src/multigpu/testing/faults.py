"""Fault injection, for tests only (inside each rank): a rank kills itself at a chosen step, once.

    MULTIGPU_FAULT_KILL_AT=1:7 multigpu train ... --max-restarts 1
    # rank 1 sends itself SIGKILL right after optimizer step 7, on the first attempt only

The variable is read once, when the trainer is set up; without it the training
loop pays one ``is None`` check per step. The kill fires only while
``TORCHELASTIC_RESTART_COUNT`` is 0, so the restarted worker group (which
resumes from the newest valid checkpoint) runs to the end.
"""

from __future__ import annotations

import os
import signal

from multigpu.checkpointing import restart_count
from multigpu.errors import ConfigError

__all__ = ["KILL_AT", "kill_step_from_env", "kill_self"]

KILL_AT = "MULTIGPU_FAULT_KILL_AT"


def kill_step_from_env(rank: int) -> int | None:
    """The step at which this rank must kill itself, or None (not asked, another rank, or a restart)."""
    value = os.environ.get(KILL_AT)
    if not value or restart_count() > 0:
        return None
    try:
        target, step = (int(part) for part in value.split(":"))
    except ValueError:
        raise ConfigError(f"{KILL_AT}={value!r} is invalid; valid: <rank>:<step>, e.g. 1:7") from None
    return step if target == rank else None


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no flush, as a crashed machine or the OOM killer would end it."""
    os.kill(os.getpid(), signal.SIGKILL)
