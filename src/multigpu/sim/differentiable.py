"""Any model, differentiable: its series as a function of learned parameters, with gradients (inside each rank).

    run = DiffRun(SimEngine(cfg))                     # this rank's agents at step 0 (data strategy)
    series = run.series({"p_tell": torch.tensor(0.2, dtype=torch.float64, requires_grad=True)})
    loss(series).backward(); run.all_reduce_grads(params)   # every rank: the same gradient

What changes from the exact engine, so a user's substeps need no autograd code:

* the learned parameters are 0-dim float64 tensors in ``ctx.params`` (``ctx.params.beta`` is a
  tensor), so arithmetic on them builds the graph;
* ``ctx.bernoulli(ids, p, stream)`` with a floating tensor ``p`` gives 0/1 floats with the
  straight-through gradient (``ctx.categorical`` for one of k), the same hard decisions forward;
* the model's floating fields are float64 and carry gradients; integer fields are as they are
  (positions, ids); a substep updates a field in place or assigns ``agents[name] = new``;
* a "cell" or "global" field's ``acc`` is float64 (add ``values.to(acc.dtype)``), summed over
  ranks with an all-reduce whose backward all-reduces the gradient (every rank's agents read the
  summed field, so its gradient is the sum of every rank's);
* a rank's agents are one chunk; ``series`` are summed over ranks once per run (float64).

Across ranks the loss is the same on every rank (it reads the summed series), each rank's
backward reaches its own agents, and :meth:`DiffRun.all_reduce_grads` sums the parameters'
gradients, so every rank takes the same optimizer step. The autograd graph of every step is
kept (memory grows with agents x steps; ``truncate`` cuts it to the last K steps).
"""

from __future__ import annotations

import copy

import torch

from multigpu.errors import ConfigError
from multigpu.sim import exchange
from multigpu.sim.api import Context, Substep
from multigpu.sim.models import KERNELS

__all__ = ["DiffRun"]


class _SumField(torch.autograd.Function):
    """A field summed over ranks; backward: the gradient summed over ranks (each rank's agents read it)."""

    @staticmethod
    def forward(ctx, local):
        return exchange.sum_field(local.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        return exchange.sum_field(grad.contiguous().clone())


class _SumSeries(torch.autograd.Function):
    """Series summed over ranks; backward: identity (the loss is computed the same on every rank)."""

    @staticmethod
    def forward(ctx, local):
        return exchange.sum_field(local.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


class DiffRun:
    """This rank's agents of a SimEngine (data strategy), run differentiably; see the module docstring."""

    def __init__(self, engine, truncate: int = 0):
        if engine.spatial:
            raise ConfigError("sim.calibrate runs the data strategy (agents split by id); set strategy=data")
        nets = [s.name for s in engine.substeps if s.field == "network"]
        if nets:
            raise ConfigError(f"sim.calibrate: substep {nets[0]!r} reads a network field, which the "
                              "differentiable mode does not support yet; valid: cell or global fields")
        self.engine, self.cfg, self.truncate = engine, engine.cfg, truncate
        self.agents0 = {k: engine.state[k].clone() for k in engine.state.schema}

    def _context(self, values: dict[str, torch.Tensor]) -> Context:
        params = copy.copy(self.engine.params)  # frozen: the learned fields become tensors on the copy only
        for name, value in values.items():
            object.__setattr__(params, name, value)
        e = self.engine
        return Context(seed=self.cfg.seed, step=0, params=params, grid=tuple(self.cfg.grid), lo=0,
                       rows=self.cfg.grid[0], kernels=dict(KERNELS), num_agents=e.num_agents,
                       env=e.model.env(e.params))

    def series(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """[steps, series] float64 summed over ranks, differentiable in ``values``. Call on all ranks."""
        ctx = self._context(values)
        agents = {k: v.to(torch.float64) if v.is_floating_point() else v.clone() for k, v in self.agents0.items()}
        rows, steps = [], self.cfg.steps
        for step in range(steps):
            ctx.step = step
            if self.truncate and step == steps - self.truncate:  # backpropagate through the last K steps only
                agents = {k: v.detach() for k, v in agents.items()}
            sums = []
            for sub in self.engine.substeps:
                prepared = sub.prepare(ctx, self._field(sub, ctx, agents)) if sub.field else None
                out = sub.apply(ctx, agents, prepared)
                if out is not None:
                    sums.append(out.reshape(-1).to(torch.float64))
            rows.append(torch.cat(sums) if sums else torch.zeros(0, dtype=torch.float64, device=self._device))
        local = torch.stack(rows) if rows else torch.zeros((0, 0), dtype=torch.float64, device=self._device)
        return _SumSeries.apply(local)

    @property
    def _device(self) -> torch.device:
        return self.agents0["id"].device

    def _field(self, sub: Substep, ctx: Context, agents: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed field ``sub`` reads, float64, with the halo rows of a cell field (periodic)."""
        if sub.field == "global":
            acc = torch.zeros(sub.field_size, dtype=torch.float64, device=self._device)
            sub.contribute(ctx, agents, acc)
            return _SumField.apply(acc)
        height, width = self.cfg.grid
        channels = sub.channels(self.engine.params)
        acc = torch.zeros((height * width + 1, *((channels,) if channels > 1 else ())), dtype=torch.float64,
                          device=self._device)
        sub.contribute(ctx, agents, acc)
        rows = _SumField.apply(acc[:-1].contiguous()).view(height, width, *acc.shape[1:])
        r = self.engine.radius
        return torch.cat([rows[height - r :], rows, rows[:r]]) if r else rows

    @staticmethod
    def all_reduce_grads(params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The parameters' gradients summed over ranks, as one float64 tensor in ``params`` order. Collective."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params.values()]
        return exchange.sum_field(torch.stack(grads).detach().clone())
