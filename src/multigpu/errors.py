"""The exception hierarchy of multigpu, every class of it (used on both sides of the launch).

Every error we raise on purpose derives from :class:`MultigpuError`. The CLI
catches it once, at the top, prints ``error: <message>`` on one line and exits
with the class's ``exit_code``; ``--debug`` shows the traceback instead. A few
classes are not ``MultigpuError``: a rank's or a test's failure, not a line the
command prints (the tree's second part).

::

    * MultigpuError                    exit 1 unless said otherwise
      x ConfigError (ValueError)       exit 2: bad input (flags, config files, arguments)
      x DeviceError                    exit 2: a device request this machine cannot meet
      x UsageError (ConfigError)       exit 2: a malformed command line
      x OutputError (OSError)          exit 2: a file cannot be written (disk full, read-only, no permission)
      x LaunchError
        + WorkerFailedError            a worker exited non-zero (rank, exitcode, message, error_file)
        + RendezvousTimeoutError
        + InterruptedBySignalError     exit 128 + N: the launcher got signal N (SIGTERM: 143)
        + NodeFailedError              another node stopped before the job formed
        + NodeLostError                a node's launcher stopped sending its heartbeat while the job ran
      x CheckpointError                a checkpoint could not be written or read
        + CheckpointWriteError         saving failed; the previous checkpoints are intact
        + CorruptCheckpointError       a checkpoint file is truncated, altered or not a checkpoint (path, reason)
        + OldLayoutError               exit 2: a run directory of an earlier checkpoint layout
      x NonFiniteError                 training met a non-finite loss or gradient norm (the step named)
      x NotInitializedError            a runtime call needing a process group before init()
      x CollectiveError
        + ShapeMismatchError           per-rank shapes listed, instead of a hang
        + CollectiveTimeoutError       a collective or barrier exceeded its timeout

    * StallError (RuntimeError)        a rank made no progress for --stall-timeout-s: recorded, the rank exits 3
    * RankFailedError (RuntimeError)   multigpu.testing.run_on_ranks: a rank raised (rank, its traceback)
    * StreamOrderError (RuntimeError)  multigpu.testing.fakecuda: data read before its stream was waited for
    * CudaInitialized (BaseException)  multigpu.testing.fakecuda.forbid_cuda_init: code made a CUDA context

The packages whose code raises them re-export their own (``multigpu.checkpoint.CorruptCheckpointError``,
``multigpu.testing.RankFailedError``, ``multigpu.testing.fakecuda.StreamOrderError``): the same classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "ConfigError",
    "CorruptCheckpointError",
    "CudaInitialized",
    "DeviceError",
    "InterruptedBySignalError",
    "LaunchError",
    "MultigpuError",
    "NodeFailedError",
    "NodeLostError",
    "NonFiniteError",
    "NotInitializedError",
    "OldLayoutError",
    "OutputError",
    "RankFailedError",
    "RendezvousTimeoutError",
    "ShapeMismatchError",
    "StallError",
    "StreamOrderError",
    "UsageError",
    "WorkerFailedError",
]


class MultigpuError(Exception):
    """Base class of every error multigpu raises on purpose."""

    exit_code: int = 1


class ConfigError(MultigpuError, ValueError):
    """Bad input: a flag, a config key or value, an argument. Exit code 2."""

    exit_code = 2


class UsageError(ConfigError):
    """A malformed command line (unknown flag, missing value). Exit code 2."""


class DeviceError(MultigpuError):
    """A device request this machine cannot meet (e.g. ``--gpus 5`` with 2 GPUs). Exit code 2."""

    exit_code = 2


class OutputError(MultigpuError, OSError):
    """A file cannot be written: the disk is full, the folder is read-only, no permission. Exit code 2.

    The message names the file and the cause (``could not write runs/x/summary.json: No space left on
    device (ENOSPC)``). Raised before anything starts where the launcher can tell, else where it happens.
    Also an ``OSError`` with the cause's ``errno``, so code that handles ``OSError`` still does.
    """

    exit_code = 2

    def __str__(self) -> str:  # the message, not OSError's "[Errno 28] ...: 'file'"
        return str(self.args[0]) if self.args else ""


class LaunchError(MultigpuError):
    """The launcher could not start or finish the job."""


class WorkerFailedError(LaunchError):
    """A worker process exited with a non-zero code.

    Attributes:
        rank: global rank of the first worker that failed.
        exitcode: its exit code (negative: killed by that signal).
        message: the one-line summary of its error.
        error_file: the JSON error file written by the worker wrapper, if any.
    """

    def __init__(self, text: str, *, rank: int, exitcode: int, message: str, error_file: str | None):
        super().__init__(text)
        self.rank = rank
        self.exitcode = exitcode
        self.message = message
        self.error_file = error_file


class RendezvousTimeoutError(LaunchError):
    """The nodes did not all join the rendezvous in time."""


class InterruptedBySignalError(LaunchError):
    """The launcher got a signal (SIGTERM from ``timeout`` or a scheduler, SIGHUP, SIGQUIT) and stopped the job.

    Its exit code is the shell's for a process ended by that signal: 128 + the signal's number.
    Ctrl-C (SIGINT) is reported as ``KeyboardInterrupt`` instead (exit 130).
    """

    def __init__(self, sig: int, cause: str | None = None):
        import signal

        self.signal = signal.Signals(sig)
        self.exit_code = 128 + int(self.signal)
        super().__init__(f"stopped by {cause or self.signal.name}: every worker was stopped")


class NodeFailedError(LaunchError):
    """Another node stopped before the job formed; the message names it and says why."""


class NodeLostError(LaunchError):
    """A node's launcher stopped sending its heartbeat while the job ran; the message names it and the last step
    each rank finished."""


class CheckpointError(MultigpuError):
    """A checkpoint could not be written or read."""


class CheckpointWriteError(CheckpointError):
    """Saving failed (e.g. the disk is full); the previous checkpoints are intact."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint file is truncated, altered, or not a checkpoint at all."""

    def __init__(self, path: str | Path, reason: str):
        super().__init__(f"checkpoint {path} is unusable: {reason}")
        self.path = Path(path)
        self.reason = reason


class OldLayoutError(CheckpointError):
    """A run directory written by an earlier layout (``ckpt_*.pt`` files, ``engine.json`` folders). Exit 2."""

    exit_code = 2


class NonFiniteError(MultigpuError):
    """Training met a non-finite loss or gradient norm (``nonfinite=stop``): the step, rank and values named."""


class NotInitializedError(MultigpuError):
    """A call that needs the process group was made before ``multigpu.init()``."""


class CollectiveError(MultigpuError):
    """A collective could not complete."""


class ShapeMismatchError(CollectiveError):
    """Ranks passed tensors whose shapes cannot be combined; lists every rank's shape."""

    def __init__(self, op: str, shapes: Sequence[object], rule: str):
        lines = [f"{op}() needs {rule}."]
        lines += [f"  rank {r}: {s}" for r, s in enumerate(shapes)]
        lines.append("Check that every rank builds its tensor from the same settings.")
        super().__init__("\n".join(lines))
        self.op = op
        self.shapes = list(shapes)


class CollectiveTimeoutError(CollectiveError):
    """A collective or barrier did not complete within its timeout."""


# ---------------------------------------------------------------- not MultigpuError: a rank's or a test's failure
class StallError(RuntimeError):
    """This rank made no progress for longer than the configured stall timeout (``--stall-timeout-s``): the
    watchdog (:mod:`multigpu.runtime.watchdog`) records it in the rank's error file and ends the rank with exit
    code 3; the launcher's failure line names it."""


class RankFailedError(RuntimeError):
    """A rank raised under :func:`multigpu.testing.run_on_ranks`; carries the failing rank and its own traceback
    text."""

    def __init__(self, rank: int, world_size: int, trace: str):
        super().__init__(f"rank {rank}/{world_size} raised an exception (other ranks were stopped):\n{trace}")
        self.rank = rank
        self.trace = trace


class StreamOrderError(RuntimeError):
    """Data read before the stream that writes it was waited for: on a GPU, a silently wrong result
    (:mod:`multigpu.testing.fakecuda`)."""


class CudaInitialized(BaseException):
    """What :func:`multigpu.testing.fakecuda.forbid_cuda_init` raises where code would create a CUDA context. A
    ``BaseException``, so that no ``except Exception`` (a capability probe's fallback, say) in the code under test
    can swallow it."""
