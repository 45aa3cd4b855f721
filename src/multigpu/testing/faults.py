"""Fault injection for tests (inside each rank): a rank kills itself at a chosen step, once; a slow disk.

A test registers the fault as a callback of the workload, through a tiny module
of its own, so that no production code path reads a fault setting::

    # tmp/fault_here.py
    from multigpu.testing.faults import KillAt
    def hook():
        return KillAt(rank=1, step=7)

    PYTHONPATH=tmp multigpu train ... callbacks=[fault_here:hook] --max-restarts 1
    # rank 1 sends itself SIGKILL right after step 7, on the first attempt only

The kill fires only on the first attempt (``restart_count() == 0``), so the
restarted worker group (which resumes from the newest valid checkpoint) runs
to the end. Callbacks run after each step and before its checkpoint
(:class:`multigpu.run.StepEvent`), so the kill comes before the checkpoint of
its own step. By default it waits first until the checkpoints written in the
background so far are on disk (a crash *after* them: the restart resumes from
the newest one, whatever the disk's speed); ``while_writing=True`` kills at
once, in the middle of a background write (:class:`SlowDisk` keeps one going).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from multigpu.checkpoint.resume import restart_count
from multigpu.runtime import group

__all__ = ["KillAt", "SlowDisk", "SlowRank", "WaitForSignal", "kill_self"]


class KillAt:
    """A callback (``on_step``) that SIGKILLs rank ``rank`` after step ``step`` of the first attempt.

    Works with every workload's step (:class:`multigpu.run.StepEvent`: train's optimizer steps, sim's steps or an
    ensemble's waves, PPO's updates). ``while_writing``: kill without waiting for the checkpoint being written in
    the background (and say on stdout which one was in flight); False: once it is on disk.
    """

    def __init__(self, rank: int, step: int, *, while_writing: bool = False):
        self.rank, self.step, self.while_writing = rank, step, while_writing
        self.armed = restart_count() == 0

    def on_step(self, event) -> None:
        if not (self.armed and event.step == self.step and group.rank() == self.rank):
            return
        checkpoints = event.run.checkpoints
        if checkpoints is not None:
            if self.while_writing:
                writing = checkpoints.writing
                what = f"step_{writing:08d}" if writing is not None else "(none)"
                print(f"fault: killing rank {self.rank} after step {self.step} while checkpoint {what} is being "
                      "written", flush=True)
            else:
                checkpoints.wait()
        kill_self()


class SlowDisk:
    """A callback that does nothing per step; made, it slows this process's writes under ``checkpoints/``: each
    ``fsync`` of such a file (DCP's shards, ``state.pt``, the manifest) first sleeps ``seconds``. A test's way
    to keep a background checkpoint write in flight long enough to kill a rank in the middle of it."""

    def __init__(self, seconds: float = 1.0):
        self.seconds = seconds
        real = os.fsync

        def fsync(fd):
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = ""
            if f"{os.sep}checkpoints{os.sep}" in path:
                time.sleep(self.seconds)
            return real(fd)

        os.fsync = fsync

    def on_step(self, event) -> None:
        pass


class SlowRank:
    """A callback that makes rank ``rank`` a straggler from step ``step`` on: each of its later steps computes
    ``seconds`` longer (a sleep inside the step as the run's step meter times it, outside any collective), as a
    slower GPU, a throttled core or a noisy neighbour would. Every attempt, every step after ``step``."""

    def __init__(self, rank: int, step: int, seconds: float = 0.1):
        self.rank, self.step, self.seconds = rank, step, seconds
        self._armed = False

    def on_step(self, event) -> None:
        if self._armed or group.rank() != self.rank or event.step < self.step - 1:
            return
        meter = event.run.meter
        timed = meter.step
        seconds = self.seconds

        @contextlib.contextmanager
        def slow_step(*args, **kwargs):
            with timed(*args, **kwargs) as count:
                yield count
                time.sleep(seconds)  # the step's own work, done slowly

        meter.step = slow_step  # this run's meter only
        self._armed = True


class WaitForSignal:
    """A callback that holds rank ``rank`` after step ``step`` until a stop signal reaches it (deadline ``timeout_s``),
    having first touched ``ready`` (a file the test waits for): a pre-emption that lands, deterministically, while
    the run is at that step. Needs a run that records signals (``on_interrupt``: train's
    ``--checkpoint-on-interrupt``)."""

    def __init__(self, rank: int, step: int, ready: str, *, timeout_s: float = 120.0):
        self.rank, self.step, self.ready, self.timeout_s = rank, step, ready, timeout_s

    def on_step(self, event) -> None:
        if event.step != self.step or group.rank() != self.rank:
            return
        print(f"fault: rank {self.rank} waits after step {self.step} for a stop signal", flush=True)
        with open(self.ready, "w"):
            pass
        deadline = time.monotonic() + self.timeout_s
        while not event.run.stop_requested:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fault: no stop signal reached rank {self.rank} within {self.timeout_s} s")
            time.sleep(0.02)


def kill_self() -> None:
    """SIGKILL this process: no cleanup, no flush, as a crashed machine or the OOM killer would end it."""
    os.kill(os.getpid(), signal.SIGKILL)
