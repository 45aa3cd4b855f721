"""Ctrl-C or SIGTERM as a request to stop after the current step, with a last checkpoint (inside each rank).

On Ctrl-C the launcher (torchrun's agent) sends SIGINT to every worker; on
SIGTERM (``timeout``, a scheduler's pre-emption, ``kill``) it sends SIGTERM, and
a scheduler may also signal the ranks themselves (``srun``, a cgroup kill). The
agent then waits up to 30 s (``TORCHELASTIC_SHUTDOWN_TIMEOUT``) before it sends
SIGKILL. By default SIGINT raises ``KeyboardInterrupt`` wherever a worker stands
and SIGTERM ends it at once. With ``checkpoint_on_interrupt``,
:class:`InterruptFlag` only records either signal while the run's steps run
(:meth:`multigpu.run.Run.steps`): nothing is written inside the signal handler.
At every step boundary the ranks agree on it with one one-element all-reduce
(the max of the signal numbers), so all of them stop after the *same* step even
when the signal reached them at different moments, or reached only some. The
run then writes a checkpoint of that step and ends, and the rank exits with
``128 + signal``: 130 for SIGINT, 143 for SIGTERM.

SIGTERM is also what the agent sends to the surviving workers when another
worker failed. A rank that records it then meets the dead peer in its next
collective and fails there (gloo at once; NCCL at its timeout, or by the
agent's SIGKILL 30 s later): the right end, since a checkpoint would wait on a
peer that is gone. The worker wrapper registers a stack dump on SIGTERM
(faulthandler, for the launcher's "where the other ranks stood"); while the
flag holds SIGTERM, its handler writes that dump itself, and faulthandler's
registration is put back when the loop ends.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading

import torch

from multigpu import envvars
from multigpu.runtime import collectives

__all__ = ["InterruptFlag"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What counts as a request to stop after this step."""

_STACK_FILE = None  # kept open while faulthandler writes to its descriptor


def _stack_path() -> str | None:
    folder = os.environ.get(envvars.STACKS_DIR)
    return os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.txt") if folder else None


def _dump_stacks() -> None:
    """Where this rank stands, in the file the worker wrapper's SIGTERM dump would have written."""
    path = _stack_path()
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            faulthandler.dump_traceback(file=fh, all_threads=True)


def _rearm_stack_dump() -> None:
    """Register the worker wrapper's SIGTERM stack dump again (``signal.signal`` replaced it)."""
    global _STACK_FILE
    path = _stack_path()
    if not path or not faulthandler.unregister(signal.SIGTERM):
        return  # not started by the launcher's wrapper: there was none
    os.makedirs(os.path.dirname(path), exist_ok=True)
    _STACK_FILE = open(path, "a")  # noqa: SIM115 - after a dump the handler wrote, not over it
    faulthandler.register(signal.SIGTERM, file=_STACK_FILE, all_threads=True, chain=True)


class InterruptFlag:
    """``with InterruptFlag(enabled) as flag: ... if flag.agreed(device): stop``; see the module docstring.

    ``signum`` is the signal the ranks agreed on (0: none). A second signal on the same
    rank while the first is pending stops it at once: SIGINT raises ``KeyboardInterrupt``
    (press Ctrl-C twice to stop a single-process run without waiting for the step to end),
    SIGTERM ends the process as SIGTERM does.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.received = 0
        """The signal this rank got (0: none)."""
        self.signum = 0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received != 0

    def __enter__(self) -> InterruptFlag:
        if self.enabled and threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        if signal.SIGTERM in self._previous:
            _rearm_stack_dump()
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGTERM:
            _dump_stacks()
        if self.requested:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received = signum

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank got SIGINT or SIGTERM. Call on all ranks, at the same step."""
        if not self.enabled:
            return False
        flag = torch.tensor([float(self.received)], device=device)
        self.signum = int(collectives.all_reduce(flag, "max", check_shapes=False).item())
        return self.signum != 0
