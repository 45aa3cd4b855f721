"""Non-finite losses and gradient norms (inside each rank): noticed without a host sync per step.

Every step's loss (this rank's) and gradient norm (the whole gradient's, the same on every rank) are
compared with ``isfinite`` on the device; the first bad step is kept there, in a tensor. The trainer
asks :meth:`FiniteGuard.check` where it synchronises anyway (a log flush, before every checkpoint):
one all-reduce of one number over the ranks; the first non-finite step of any rank then ends training on
every rank with :class:`~multigpu.errors.NonFiniteError`, naming the step, the rank and the values,
before a checkpoint of the broken weights could rotate a good one out.

``nonfinite=skip`` instead skips the optimizer step whose gradient norm is not finite (the same decision
on every rank: the norm is global), which costs one host sync per step on a GPU. Under fp16 the grad
scaler already skips steps with overflowing gradients (and lowers its scale): there only the loss counts.
"""

from __future__ import annotations

import torch

import multigpu as mg
from multigpu.errors import NonFiniteError

__all__ = ["FiniteGuard"]

_NONE = torch.iinfo(torch.int64).max
"""The first bad step when there is none."""


class FiniteGuard:
    def __init__(self, device: torch.device, *, scaler_skips: bool):
        self.scaler_skips = scaler_skips
        self._first = torch.full((), _NONE, dtype=torch.int64, device=device)
        self._values = torch.zeros(2, dtype=torch.float64, device=device)

    def update(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Record ``step`` if it is the first non-finite one of this rank (device ops only, no sync)."""
        bad = torch.isfinite(loss).logical_not()  # not ``~``: the same, and fake CUDA (tests/fakecuda) can run it
        if not self.scaler_skips:
            bad = bad | torch.isfinite(grad_norm).logical_not()
        new = bad & (self._first == _NONE)
        self._first = torch.where(new, step, self._first)
        values = torch.stack([loss.detach().double().reshape(()), grad_norm.detach().double().reshape(())])
        self._values = torch.where(new, values.to(self._values.device), self._values)

    def check(self, now: int, next_checkpoint: str | None) -> None:
        """Raise NonFiniteError on every rank if any rank saw a non-finite step. Call on all ranks, same step."""
        world = mg.world_size()
        # of the ranks at the earliest bad step, one whose own loss went bad first (the others' norm follows it)
        loss_ok = torch.isfinite(self._values[0]).to(torch.int64)
        code = torch.where(self._first == _NONE, _NONE, (self._first * 2 + loss_ok) * world + mg.rank())
        first = int(mg.all_reduce(code.clone(), "min", check_shapes=False).item())
        if first == _NONE:
            return
        step, rank = first // (2 * world), first % world
        # only when stopping: every rank's values, to name them (on the device: NCCL reduces nothing else)
        table = torch.zeros(world, 2, dtype=torch.float64, device=self._values.device)
        table[mg.rank()] = self._values
        loss, norm = mg.all_reduce(table, "sum", check_shapes=False)[rank].tolist()
        where = f" on rank {rank}" if world > 1 else ""
        kept = f"; {next_checkpoint}" if next_checkpoint else ""
        raise NonFiniteError(
            f"the loss is {loss:g} and the gradient norm {norm:g} at step {step}{where} (its first non-finite "
            f"step); training stopped at step {now}, before a checkpoint of the broken weights{kept}; valid: a "
            "lower lr, grad_clip, finite data, or nonfinite=skip to skip such steps")
