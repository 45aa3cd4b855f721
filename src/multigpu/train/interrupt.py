"""Ctrl-C as a request to stop after the current step, with a last checkpoint (inside each rank).

On Ctrl-C the launcher (torchrun's agent) sends SIGINT to every worker and
waits up to 30 s (``TORCHELASTIC_SHUTDOWN_TIMEOUT``) before it sends SIGKILL.
By default SIGINT raises ``KeyboardInterrupt`` wherever a worker stands. With
``checkpoint_on_interrupt``, :class:`InterruptFlag` only records the request
while the training loop runs; at every step boundary the ranks agree on it with
one one-element all-reduce (max), so all of them stop after the *same* step even
when the signal reached them at different moments, or reached only some. The
loop then writes a checkpoint and returns.

Only SIGINT is caught. SIGTERM is what the agent sends to the survivors when
another worker failed (before a restart, or the end): they dump their stacks
and stop at once, because a checkpoint would wait on a peer that is gone.
"""

from __future__ import annotations

import signal
import threading

import torch

import multigpu as mg

__all__ = ["InterruptFlag"]


class InterruptFlag:
    """``with InterruptFlag(enabled) as flag: ... if flag.agreed(device): stop``; see the module docstring.

    A second SIGINT on the same rank while the first is pending raises ``KeyboardInterrupt``
    (press Ctrl-C twice to stop a single-process run without waiting for the step to end).
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.requested = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> InterruptFlag:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """True on every rank once any rank got SIGINT. Call on all ranks, at the same step."""
        if not self.enabled:
            return False
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        return bool(mg.all_reduce(flag, "max", check_shapes=False).item() > 0)
