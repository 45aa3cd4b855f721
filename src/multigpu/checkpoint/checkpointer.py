"""One run's checkpoints: the store, when a checkpoint is due, and the writer that keeps saving off the
critical path (inside each rank).

    checkpoints = Checkpointer(run_dir / "checkpoints", every=100, keep_last=3, mode="async")
    if checkpoints.due(step):
        checkpoints.save(step, state, meta=...)   # all ranks; async: returns once the state is staged
    ...
    checkpoints.close()                           # all ranks: the last write is on disk (or its error raised)

``mode="sync"`` writes in ``save`` (every rank waits for the files, the manifest and the rename).
``mode="async"`` (the default) splits a save in two:

1. **staging**, on the calling thread between two steps: the state is copied to host memory
   (:mod:`multigpu.checkpoint.staging`; pinned on GPUs), and the run goes on;
2. **writing**, on a thread of its own: every rank its DCP shards, rank 0 ``state.pt`` and the checksummed
   manifest, each file fsynced; the temporary ``.step_<n>.tmp/`` folder becomes ``step_<n>/`` in one rename
   only after its last byte is on disk (:meth:`CheckpointStore.write`). A process killed meanwhile leaves the
   hidden temporary folder, which nothing reads; the run resumes from the last complete checkpoint.

At most one save is in flight: a save that comes due while the previous one is still being written waits for
it (the run says so once). A write that failed (a full disk) raises its :class:`CheckpointWriteError` on every
rank at the next save or at :meth:`close`, all at the same step.

**Collectives from the writer thread.** A write coordinates the ranks (rank 0 opens the folder and tells the
others, DCP plans and gathers its metadata, rank 0 gathers every rank's file checksums and says whether the
rename happened). On the default process group these messages would interleave with the step's collectives
issued meanwhile by the main thread (DDP's all-reduce, a log point), which gloo and NCCL pair by order of
issue: a deadlock or a corrupt message. So the writer uses a gloo process group of its own, made once per
job on every rank (``dist.new_group``, a collective call, on the main thread) and passed to
``dcp.save(process_group=...)`` as ``dcp.async_save`` asks for (torchtitan does the same): gloo, so that the
writer sends staged host memory and never queues work on a CUDA stream the step uses.

Why not ``dcp.async_save`` itself: it does the same two halves for the sharded parts only (staged by
``BlockingAsyncStager``, which staging here uses too, then ``save`` on a thread with the given group), but a
step folder is complete only once rank 0's ``state.pt``, every file's checksum and the manifest follow DCP's
files and the folder is renamed; one writer thread runs that whole sequence in order, and a job with no
sharded part (DDP, rl) gets the same machinery. Only APIs present in torch 2.4 and later are used.

Where async is not the right mode: when the host cannot hold one more copy of what each rank checkpoints
(the staged copy stays in memory between saves), and where every checkpoint must be on disk before the
next step starts (nothing in multigpu needs that: a resumed run starts from the newest *complete* one).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from multigpu.checkpoint.staging import Stager
from multigpu.checkpoint.store import CheckpointStore, Exchange
from multigpu.errors import CheckpointWriteError

__all__ = ["MODES", "Checkpointer"]

MODES = ("async", "sync")
"""``checkpoint_mode``: write in the background after staging (async), or before the run goes on (sync)."""

_WRITER_GROUP: tuple[Any, Any] | None = None  # (the default group it was made beside, the writer's gloo group)


def writer_group():
    """The gloo process group of checkpoint writers, made once per job beside the default group (all ranks
    call this on their main thread, at the same point); None without a process group."""
    global _WRITER_GROUP
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _WRITER_GROUP is None or _WRITER_GROUP[0] is not world:  # a new job in this process: a new group
        from datetime import timedelta

        from multigpu.runtime import group

        _WRITER_GROUP = (world, dist.new_group(backend="gloo", timeout=timedelta(seconds=group.timeout_s())))
    return _WRITER_GROUP[1]


def _say(line: str) -> None:
    from multigpu.runtime import group

    if group.rank() == 0:
        print(line, flush=True)


class _Write:
    """One background write: its thread and its outcome."""

    def __init__(self, step: int, write: Callable[[], Any]):
        self.step = step
        self.future: Future = Future()
        self.thread = threading.Thread(target=self._main, args=(write,), name=f"multigpu-checkpoint-{step}",
                                       daemon=True)  # a process that exits (or is killed) never waits on it
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self.thread.start()

    def _main(self, write: Callable[[], Any]) -> None:
        try:
            result = write()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.seconds = time.perf_counter() - self.started
            self.future.set_exception(exc)
        else:
            self.seconds = time.perf_counter() - self.started
            self.future.set_result(result)


class Checkpointer:
    """The store of one run, its cadence and its writer; see the module docstring.

    Args:
        directory: The store's folder (``<run_dir>/checkpoints``).
        every: A checkpoint every this many steps (0: only when asked, e.g. the last step).
        keep_last: Checkpoints kept (older ones are deleted after each successful write).
        mode: "async" (stage, then write on a thread) or "sync" (write before returning).
        say: One line on rank 0 (the wait for a slow write); default: print.

    Make it on every rank at the same point (async: it makes the writer's process group, once per job).
    """

    def __init__(self, directory: str | Path, *, every: int = 0, keep_last: int = 3, mode: str = "async",
                 say=None):
        if mode not in MODES:
            from multigpu.errors import ConfigError

            raise ConfigError(f"checkpoint_mode={mode!r} is invalid; valid: {', '.join(MODES)}")
        self.store = CheckpointStore(directory, keep_last)
        self.every, self.mode = every, mode
        self.say = say or _say
        self._stager = Stager() if mode == "async" else None
        # the writer's process group: made here, on every rank's main thread (a collective call), not in a save
        self._exchange = Exchange(writer_group()) if mode == "async" else None
        self._pending: _Write | None = None
        self._said_wait = False
        self.last: Path | None = None
        """The newest checkpoint known complete on disk."""
        self.stall_s: list[float] = []
        """Per save: seconds the calling thread spent in :meth:`save` (staging, a wait, a sync write)."""
        self.write_s: list[float] = []
        """Per completed write: seconds from its start to its rename (async: on the writer thread)."""
        self.waits = 0
        """Saves that came due while the previous write was still running, and waited for it."""

    @property
    def directory(self) -> Path:
        return self.store.directory

    def path_for(self, step: int) -> Path:
        return self.store.path_for(step)

    def due(self, step: int) -> bool:
        """Whether the cadence asks for a checkpoint after step ``step`` (steps done)."""
        return self.every > 0 and step > 0 and step % self.every == 0

    @property
    def writing(self) -> int | None:
        """The step whose checkpoint is being written in the background (None: none)."""
        return self._pending.step if self._pending is not None and not self._pending.future.done() else None

    def save(self, step: int, state: dict[str, Any], *, meta: dict[str, Any] | None = None) -> Path:
        """Checkpoint ``step`` of ``state``. Call on all ranks, at the same step.

        async: waits for the previous write if it is still running, stages, starts the write and returns the
        folder it will have; sync: writes it. Raises the previous background write's error, if it failed."""
        start = time.perf_counter()
        try:
            if self.mode == "sync":
                path = self.store.save(step, state, meta=meta)
                self.last = path
                self.write_s.append(time.perf_counter() - start)
                return path
            self.wait(due=step)
            snap = self.store.snapshot(step, state, meta=meta, stager=self._stager)
            _quiet_dcp()
            exchange = self._exchange
            self._pending = _Write(step, lambda: self.store.write(snap, exchange))
            return self.store.path_for(step)
        finally:
            self.stall_s.append(time.perf_counter() - start)

    def wait(self, *, due: int | None = None) -> Path | None:
        """Wait until the background write (if any) has finished; raise its error. Call on all ranks.

        ``due``: the step of a save that has to wait for it (said once per run, on rank 0)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self.last
        if not pending.future.done() and due is not None:
            self.waits += 1
        if not pending.future.done() and due is not None and not self._said_wait:
            self._said_wait = True
            self.say(f"checkpoint: step_{pending.step:08d} is still being written when step {due} is due; the "
                     "run waits for it (at most one checkpoint is written at a time; said once: checkpoint less "
                     "often, or to a faster disk, to keep the run from waiting)")
        from multigpu.runtime import group, watchdog

        limit = max(group.timeout_s(), 60.0)
        deadline = time.monotonic() + limit
        while not pending.future.done():
            pending.thread.join(timeout=min(5.0, max(deadline - time.monotonic(), 0.0)))
            watchdog.heartbeat(f"writing checkpoint step_{pending.step:08d}")
            if not pending.future.done() and time.monotonic() >= deadline:
                raise CheckpointWriteError(
                    f"checkpoint {self.store.path_for(pending.step)} was still being written after {limit:g} s "
                    "(the collective timeout, --timeout-s): the disk or a rank's writer is stuck; the previous "
                    "checkpoints are intact")
        self.last = pending.future.result()  # raises the write's error on this rank (every rank has it)
        self.write_s.append(pending.seconds or 0.0)
        return self.last

    def close(self) -> Path | None:
        """The last write finished (its error raised). Call on all ranks."""
        return self.wait()


_QUIETED = False


def _quiet_dcp() -> None:
    """DCP in one process (no group) warns that it "assumes the intent" to save locally: it is the intent. Said
    with a filter of the process, once: ``warnings.catch_warnings`` is not safe on a second thread."""
    global _QUIETED
    if not _QUIETED:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        _QUIETED = True
