"""Gradient-descent calibration of any model's float parameters; the differentiable SIR (inside each rank).

    multigpu sim --model examples.sim_rumour:MODEL --calibrate target.csv calibrate.learn=[p_tell,p_forget]

Any model: ``calibrate.learn`` names float fields of its parameters (default: the model's
``learnable``); :mod:`multigpu.sim.differentiable` runs its substeps with those parameters as
tensors and ``ctx.bernoulli`` straight-through, and the loss (``calibrate.loss``: mse or poisson,
``calibrate.weights`` per series) compares any of its series with the target. The built-in SIR
uses its own differentiable model below (checkpointed steps, 5 bytes per agent-step).

Before a fit is reported, the target must carry signal: a target whose series all vary by less
than 1% of the agents, or a first gradient that is zero for every learned parameter, ends with
"no fit: ..." (``CalibrationResult.fitted`` False) instead of a fitted value.

    multigpu sim -f sir params.beta=0.05 --agents 1_000_000 --steps 40 --run-dir runs/target   # a target
    multigpu sim -f sir params.beta=0.02 --agents 1_000_000 --steps 40 --nproc-per-node 2 \\
        --calibrate runs/target/series.csv calibrate.learn=[beta]                          # recovers beta

In ``differentiable: true`` mode the SIR model's stochastic decisions are
relaxed with the straight-through Bernoulli estimator (AgentTorch's choice):
the forward pass takes the same hard decisions as the exact model (the same
counter-based numbers ``u`` per agent, compared as floats: ``u < p``), and the
backward pass treats ``d decision / d p`` as 1. Agent states are 0/1 floats
(S, I, R), so per-cell infected counts and the aggregate series are exact
integers in the forward pass, and the gradient of a loss on the series with
respect to ``beta`` and ``gamma`` flows through every step.

Memory: the forward pass runs without a graph and keeps, per agent and step,
the positions and the state (5 bytes: int16 x, y, uint8 state). The backward
pass goes through the steps in reverse, rebuilding one step's graph at a time
from what was kept (checkpointed steps), so the graph of only one step is ever
alive; ``calibrate.truncate`` > 0 backpropagates through the last K steps only.

Across ranks (the data strategy: agents split by id, the grid's infected
counts summed each step): in the reverse pass the gradient of each step's
global field is all-reduced (every rank's agents read the summed field), and
at the end the parameters' gradients are all-reduced, so every rank holds the
same gradient and takes the same optimizer step. The collectives run in the
same order on every rank (one per step, then one for the parameters), never
inside autograd's own scheduling.
"""

from __future__ import annotations

import csv
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from multigpu.errors import ConfigError
from multigpu.runtime import group
from multigpu.sim import exchange, rng
from multigpu.sim.calibration_config import LEARNABLE, LOSSES, CalibrateConfig, check_learning
from multigpu.sim.models import I, R, S, move_kernel, pressure

__all__ = ["LEARNABLE", "LOSSES", "CalibrateConfig", "CalibrationResult", "DiffSIR", "calibrate", "check_learning",
           "descend", "descend_model", "flat_target", "read_target", "relaxed_run", "series_loss", "target_columns"]

FLAT = 0.01
"""A target column varies by less than this share of the agents over the run: too little signal to fit."""


def read_target(path: str | Path, steps: int, columns: tuple[str, ...] = (),
                default: tuple[str, ...] = ("I", "R")) -> dict[str, torch.Tensor]:
    """The target series for steps 1..``steps`` from a CSV (header: step and series names). One-line errors.

    Without ``columns``, those of ``default`` the CSV has.
    """
    path = Path(path)
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as exc:
        raise ConfigError(f"sim.calibrate.target '{path}' cannot be read: {exc.strerror}") from None
    if not rows or "step" not in rows[0]:
        raise ConfigError(f"sim.calibrate.target '{path}' needs a header with a 'step' column and S, I or R")
    wanted = list(columns) or [c for c in default if c in rows[0]]
    missing = [c for c in wanted if c not in rows[0]]
    if missing or not wanted:
        raise ConfigError(f"sim.calibrate.target '{path}' has no column {missing or list(default)}; "
                          f"it has {', '.join(rows[0])}")
    try:
        by_step = {int(float(r["step"])): r for r in rows}
        series = {c: [float(by_step[s][c]) for s in range(1, steps + 1)] for c in wanted}
    except KeyError as exc:
        raise ConfigError(f"sim.calibrate.target '{path}' has no row for step {exc.args[0]}; it must cover steps "
                          f"1..{steps}") from None
    except ValueError as exc:
        raise ConfigError(f"sim.calibrate.target '{path}': {exc}") from None
    return {c: torch.tensor(v, dtype=torch.float64) for c, v in series.items()}


def _straight_through(hard: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``hard`` (0/1) in the forward pass, gradient 1 with respect to ``p`` in the backward pass."""
    return hard.to(p.dtype) + p - p.detach()


class DiffSIR:
    """SIR on the grid with relaxed decisions, for one rank's agents of a SimEngine (data strategy)."""

    def __init__(self, engine):
        cfg = engine.cfg
        if cfg.model != "sir" or engine.spatial or engine.params.seir:
            raise ConfigError("differentiable mode supports model sir (seir: false) with strategy data")
        self.engine, self.cfg, self.params = engine, cfg, engine.params
        self.ids = engine.state["id"].clone()
        self.x0, self.y0 = engine.state["x"].clone(), engine.state["y"].clone()
        self.state0 = engine.state["state"].clone()
        self.height, self.width = cfg.grid
        self.world = group.world_size()

    # ---------------------------------------------------------------- one step
    def _move(self, x, y, step):
        x, y = x.clone(), y.clone()
        move_kernel(self.ids, x, y, rng.step_key(self.cfg.seed, step, rng.STREAM_MOVE),
                    rng.threshold(self.params.move_prob, 16), self.height, self.width)
        return x, y

    def _cells(self, x, y):
        return y.to(torch.int64) * self.width + x.to(torch.int64)

    def _local_field(self, cell, i):
        return torch.zeros(self.height * self.width, dtype=i.dtype, device=i.device).index_add(0, cell, i)

    def _global_field(self, local):
        return exchange.sum_field(local.detach().clone())

    def _transition(self, step, cell, s, i, r, field, beta, gamma):
        """The relaxed SIR transition of one step; ``field`` is the summed infected count per cell."""
        radius = self.params.radius
        grid = field.view(self.height, self.width)
        if radius:
            grid = pressure(torch.cat([grid[-radius:], grid, grid[:radius]]), radius)
        k = grid.reshape(-1)[cell]
        bits = rng.random_bits(self.ids, rng.step_key(self.cfg.seed, step, rng.STREAM_TRANSITION))
        u = rng.low_bits(bits, 24, shift=8).to(torch.float64) * (1.0 / (1 << 24))
        p_inf = 1.0 - torch.pow(1.0 - beta, k)
        infected = _straight_through(u < p_inf, p_inf) * s
        recovered = _straight_through(u < gamma, gamma.expand_as(u)) * i
        return s - infected, i + infected - recovered, r + recovered

    @staticmethod
    def _onehot(state):
        return [(state == code).to(torch.float64) for code in (S, I, R)]

    # ---------------------------------------------------------------- forward and backward
    def forward(self, beta: float, gamma: float) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
        """Run every step without a graph: (what the backward pass keeps per step, global S, I, R per step)."""
        kept, counts = self.forward_counts(beta, gamma)
        series = {"S": [], "I": [], "R": []}
        for row in counts.tolist():  # the one host read of the forward pass
            for name, v in zip("SIR", row, strict=True):
                series[name].append(v)
        return kept, series

    def forward_counts(self, beta: float, gamma: float) -> tuple[list[torch.Tensor], torch.Tensor]:
        """:meth:`forward` with the series left on the agents' device: [steps, 3] int64 (S, I, R), summed
        over ranks in one all-reduce after the last step (integer sums: the same as one per step)."""
        dev = self.ids.device
        b = torch.full((), beta, dtype=torch.float64, device=dev)  # filled there, not copied from the host
        g = torch.full((), gamma, dtype=torch.float64, device=dev)
        x, y, state = self.x0, self.y0, self.state0
        kept, local = [], []
        with torch.no_grad():
            for step in range(self.cfg.steps):
                x, y = self._move(x, y, step)
                kept.append((x, y, state))
                s, i, r = self._onehot(state)
                cell = self._cells(x, y)
                field = self._global_field(self._local_field(cell, i))
                s, i, r = self._transition(step, cell, s, i, r, field, b, g)
                state = (I * i + R * r).round().to(torch.uint8)  # S=0: the hard state back as a code
                local.append(torch.stack([s.sum(), i.sum(), r.sum()]).round().to(torch.int64))
        counts = torch.stack(local) if local else torch.zeros((0, 3), dtype=torch.int64, device=dev)
        return kept, exchange.sum_field(counts)

    def gradient(self, kept, grad_series: dict[str, torch.Tensor], beta: float, gamma: float,
                 truncate: int = 0) -> dict[str, float]:
        """d loss / d (beta, gamma), given d loss / d series (one value per step and column). Call on all ranks."""
        grads = self.gradient_tensor(kept, grad_series, beta, gamma, truncate).tolist()  # the one host read
        return {"beta": grads[0], "gamma": grads[1]}

    def gradient_tensor(self, kept, grad_series: dict[str, torch.Tensor], beta: float, gamma: float,
                        truncate: int = 0) -> torch.Tensor:
        """:meth:`gradient` as a float64 tensor [d/d beta, d/d gamma] on the agents' device."""
        dev = self.ids.device
        b = torch.full((), beta, dtype=torch.float64, device=dev, requires_grad=True)
        g = torch.full((), gamma, dtype=torch.float64, device=dev, requires_grad=True)
        n = self.ids.numel()
        zero = torch.zeros((), dtype=torch.float64, device=dev)
        grad_series = {c: v.to(dev) for c, v in grad_series.items()}  # one copy, not one per step
        carry = [torch.zeros(n, dtype=torch.float64, device=dev) for _ in range(3)]  # d loss / d (s, i, r) after
        first = max(0, len(kept) - truncate) if truncate else 0
        for step in reversed(range(first, len(kept))):
            x, y, state = kept[step]
            s, i, r = (v.requires_grad_() for v in self._onehot(state))
            cell = self._cells(x, y)
            local = self._local_field(cell, i)
            field = self._global_field(local).requires_grad_()
            out = self._transition(step, cell, s, i, r, field, b, g)
            sums = torch.stack([v.sum() for v in out])
            grad_sums = torch.stack([grad_series[c][step] if c in grad_series else zero for c in "SIR"])
            torch.autograd.backward([*out, sums], [*carry, grad_sums])
            # every rank's agents read the summed field: its gradient is the sum of every rank's
            field_grad = exchange.sum_field(field.grad.clone())
            torch.autograd.backward(local, field_grad)
            carry = [v.grad for v in (s, i, r)]
        grads = torch.stack([b.grad if b.grad is not None else zero, g.grad if g.grad is not None else zero])
        return exchange.sum_field(grads)  # each rank holds its own agents' share


@dataclass
class CalibrationResult:
    """What :func:`calibrate` returns (the same on every rank)."""

    params: dict[str, float]
    """The learned parameters (the starting values when there was no fit)."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """Per iteration: loss, parameters, gradients, seconds."""
    series: dict[str, list] = field(default_factory=dict)
    """The last forward pass's series."""
    fitted: bool = True
    """False when the target carried too little signal to fit (``reason`` says why)."""
    reason: str = ""


def loss_and_grads(series: dict[str, list[int]], target: dict[str, torch.Tensor], num_agents: int):
    """Mean squared error of the series as shares of the agents, and d loss / d series."""
    total, grads = 0.0, {}
    count = sum(t.numel() for t in target.values())
    for name, want in target.items():
        got = torch.tensor(series[name][: want.numel()], dtype=torch.float64)
        diff = (got - want) / num_agents
        total += float((diff**2).sum()) / count
        grads[name] = 2.0 * diff / (num_agents * count)
    return total, grads


def series_loss(got: torch.Tensor, names: list[str], target: dict[str, torch.Tensor], num_agents: int,
                cfg: CalibrateConfig) -> torch.Tensor:
    """The loss of ``got`` ([steps, len(names)], differentiable) against ``target``, per ``cfg.loss`` and weights.

    mse: the mean squared difference of the series as shares of the agents; poisson: the mean Poisson
    negative log-likelihood of the target's counts with the series as their means, over the agents.
    """
    weights = dict(zip(cfg.columns, cfg.weights, strict=True)) if cfg.weights else {}
    count = sum(t.numel() for t in target.values())
    total = torch.zeros((), dtype=torch.float64, device=got.device)
    for name, want in target.items():
        g, w = got[: want.numel(), names.index(name)], want.to(got.device)
        if cfg.loss == "poisson":
            term = torch.nn.functional.poisson_nll_loss(g, w, log_input=False, full=False, eps=1e-8,
                                                        reduction="sum") / num_agents
        else:
            term = (((g - w) / num_agents) ** 2).sum()
        total = total + weights.get(name, 1.0) * term
    return total / count


def flat_target(target: dict[str, torch.Tensor], num_agents: int) -> str:
    """Why ``target`` carries too little signal (every column varies by < FLAT of the agents), or ""."""
    ranges = {c: float(v.max() - v.min()) if v.numel() else 0.0 for c, v in target.items()}
    if all(r < FLAT * num_agents for r in ranges.values()):
        spans = ", ".join(f"{c} by {r:,.0f}" for c, r in ranges.items())
        return (f"the target series vary by less than {FLAT:.0%} of the {num_agents:,} agents ({spans}): too "
                "little signal to learn from; make a target where they change (more steps, agents closer "
                "together, more of them active at the start)")
    return ""


def _descend(values: dict[str, float], learn: tuple[str, ...], cfg: CalibrateConfig, evaluate, *, clamp: bool,
             log) -> CalibrationResult:
    """Adam on log-parameters; ``evaluate(values)`` -> (loss, {param: gradient}, series). Call on all ranks."""
    logs = {p: torch.tensor(math.log(values[p]), dtype=torch.float64, requires_grad=True) for p in learn}
    opt = torch.optim.Adam(list(logs.values()), lr=cfg.lr, betas=(0.5, 0.9))  # short memory: the loss is noisy
    decay = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=cfg.decay)
    result = CalibrationResult(params=dict(values))
    for it in range(cfg.iterations):
        t = time.perf_counter()
        loss, grads, series = evaluate(values)
        if it == 0 and loss > 0 and all(abs(grads[p] * values[p]) <= 1e-9 * loss for p in learn):
            result.fitted = False
            result.reason = (f"the loss does not change with {', '.join(learn)} (gradient "
                             f"{', '.join(f'{grads[p]:+.1e}' for p in learn)} at the start): the target series "
                             "carry no signal about them")
        opt.zero_grad()
        for p, theta in logs.items():
            theta.grad = torch.tensor(grads[p] * values[p], dtype=torch.float64)  # chain rule through exp
        opt.step()
        decay.step()
        before = dict(values)
        for p, theta in logs.items():
            v = math.exp(float(theta.detach()))
            values[p] = min(max(v, 1e-6), 1.0 - 1e-6) if clamp else v
        record = {"iteration": it, "loss": loss, **{p: before[p] for p in learn},
                  **{f"grad_{p}": grads[p] for p in learn}, "seconds": time.perf_counter() - t}
        result.history.append(record)
        result.series = series
        if not result.fitted:
            values = before
            break
        log(f"iteration {it}: loss {loss:.3e}, " + ", ".join(f"{p} {before[p]:.5f} -> {values[p]:.5f} "
                                                             f"(grad {grads[p]:+.3e})" for p in learn))
        if all(abs(values[p] - before[p]) <= cfg.tolerance * before[p] for p in learn):
            break
    result.params = {**result.params, **values}
    return result


def _mean_series(runs: list[dict[str, list]]) -> dict[str, list]:
    """The mean of several runs' series, step by step (one run: its own, as integers)."""
    if len(runs) == 1:
        return runs[0]
    return {c: [sum(v) / len(runs) for v in zip(*(r[c] for r in runs), strict=True)] for c in runs[0]}


def descend(engine, target: dict[str, torch.Tensor], cfg: CalibrateConfig, *, log=print,
            engines: list | None = None) -> CalibrationResult:
    """The built-in SIR: gradient descent on its differentiable model (checkpointed steps). Call on all ranks.

    ``engines``: one per replicate (default: ``[engine]``); the loss is that of their mean series, and the
    gradient of each replicate's series is the mean's over their number.
    """
    models = [DiffSIR(e) for e in (engines or [engine])]
    learn = cfg.learn or ("beta",)
    values = {"beta": engine.params.beta, "gamma": engine.params.gamma}

    def evaluate(values):
        runs = [m.forward(values["beta"], values["gamma"]) for m in models]
        series = _mean_series([s for _, s in runs])
        got = torch.tensor([series[c] for c in "SIR"], dtype=torch.float64).T.requires_grad_()
        loss = series_loss(got, list("SIR"), target, engine.num_agents, cfg)
        loss.backward()
        grad_series = {c: got.grad[:, j] / len(models) for j, c in enumerate("SIR") if c in target}
        grads = {"beta": 0.0, "gamma": 0.0}
        for model, (kept, _) in zip(models, runs, strict=True):
            for p, g in model.gradient(kept, grad_series, values["beta"], values["gamma"], cfg.truncate).items():
                grads[p] += g
        return float(loss.detach()), grads, series

    return _descend(values, learn, cfg, evaluate, clamp=True, log=log)


def descend_model(engine, target: dict[str, torch.Tensor], cfg: CalibrateConfig, *, log=print,
                  engines: list | None = None) -> CalibrationResult:
    """Any model: gradient descent through :class:`DiffRun` (data strategy). Call on all ranks.

    ``engines``: one per replicate (default: ``[engine]``); the loss is that of their mean series.
    """
    from multigpu.sim.differentiable import DiffRun

    runs = [DiffRun(e, cfg.truncate) for e in (engines or [engine])]
    learn = cfg.learn or engine.model.learnable
    names = engine.series_names
    dev = engine.device

    def evaluate(values):
        leaves = {p: torch.full((), values[p], dtype=torch.float64, device=dev, requires_grad=True) for p in learn}
        got = torch.stack([run.series(leaves) for run in runs]).mean(0)
        loss = series_loss(got, names, target, engine.num_agents, cfg)
        if loss.requires_grad:  # not when no learned parameter reaches the series (then: no fit)
            loss.backward()
        grads = runs[0].all_reduce_grads(leaves).tolist()  # every rank: the same gradient, the same step
        mean = got.detach() if len(runs) > 1 else got.detach().round().to(torch.int64)
        series = {n: mean[:, j].tolist() for j, n in enumerate(names)}
        return float(loss.detach()), dict(zip(learn, grads, strict=True)), series

    values = {p: float(getattr(engine.params, p)) for p in learn}
    return _descend(values, learn, cfg, evaluate, clamp=False, log=log)


def calibrate(cfg, target: dict[str, torch.Tensor] | None = None, *, run_dir: str | Path | None = None,
              log=None) -> CalibrationResult:
    """Learn ``cfg.calibrate.learn`` from ``target`` (default: the CSV ``cfg.calibrate.target``). Call on all ranks.

    Starts from ``cfg.params``. Every rank returns the same result; rank 0 prints each iteration and, with
    ``run_dir``, writes ``calibration.csv`` (one row per iteration) and ``calibration.json``. A target with
    too little signal returns ``fitted=False`` and the reason, without descending.

    Example (2 ranks, 1M agents about 8 per cell; the target made by an exact run with beta 0.05)::

        cfg = mg.sim.SimConfig(model="sir", agents=1_000_000, steps=30, grid=(350, 350), params={"beta": 0.02,
                               "initial_infected": 0.01}, calibrate={"target": "runs/target/series.csv"})
        result = mg.sim.calibrate(cfg)          # result.params["beta"] close to 0.05
    """
    from multigpu.monitor import write_json_atomic
    from multigpu.sim.engine import SimEngine

    ccfg = cfg.calibrate
    sir = cfg.model == "sir"
    if target is None:
        target = read_target(ccfg.target, cfg.steps, ccfg.columns, default=target_columns(cfg))
    main = group.rank() == 0
    printer = log or ((lambda line: print(f"calibrate: {line}", flush=True)) if main else (lambda line: None))
    engine = SimEngine(cfg)
    engines = [engine]
    if ccfg.replicates > 1:  # the seeds of an ensemble's replicates 0..K-1 (its first sweep point)
        import dataclasses

        from multigpu.sim.design import replicate_seed

        engines = [SimEngine(dataclasses.replace(cfg, seed=replicate_seed(cfg.seed, 0, k)))
                   for k in range(ccfg.replicates)]
        engine = engines[0]
    flat = flat_target(target, engine.num_agents)
    if flat:
        learn = ccfg.learn or engine.model.learnable
        result = CalibrationResult(params={p: float(getattr(engine.params, p)) for p in learn}, fitted=False,
                                   reason=flat)
    else:
        result = (descend if sir else descend_model)(engine, target, ccfg, log=printer, engines=engines)
    if run_dir is not None and main:
        from multigpu.sim.runner import write_csv

        run_dir = Path(run_dir)
        if result.history:
            names = list(result.history[0])
            write_csv({n: [h[n] for h in result.history] for n in names}, run_dir / "calibration.csv")
        import resource

        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        write_json_atomic(run_dir / "calibration.json", {
            "params": result.params, "fitted": result.fitted, "reason": result.reason,
            "iterations": len(result.history), "final_loss": result.history[-1]["loss"] if result.history else None,
            "learn": list(ccfg.learn or engine.model.learnable), "loss": ccfg.loss, "target": ccfg.target,
            "world_size": group.world_size(), "agents": engine.num_agents, "steps": cfg.steps,
            "replicates": ccfg.replicates,
            "peak_rss_mb_rank0": peak_mb,
            "seconds_per_iteration": (sum(h["seconds"] for h in result.history) / len(result.history)
                                      if result.history else None)})
    return result


def target_columns(cfg) -> tuple[str, ...]:
    """The series a target is compared on by default: sir's I and R; every series of another model."""
    if cfg.model == "sir":
        return ("I", "R")
    from multigpu.sim.api import get_model, model_params

    model = get_model(cfg.model)
    params = model_params(model, cfg.params)
    return tuple(n for s in (model.substep(n) for n in cfg.substep_names) for n in s.series(params))


def relaxed_run(cfg) -> dict[str, list]:
    """The differentiable model's forward pass alone (``differentiable: true`` without a target). Call on all ranks."""
    from multigpu.sim.engine import SimEngine

    engine = SimEngine(cfg)
    if cfg.model == "sir":
        _, series = DiffSIR(engine).forward(engine.params.beta, engine.params.gamma)
        return {"step": list(range(1, cfg.steps + 1)), **series}
    from multigpu.sim.differentiable import DiffRun

    with torch.no_grad():
        got = DiffRun(engine).series({})
    return {"step": list(range(1, cfg.steps + 1)),
            **{n: got[:, j].round().to(torch.int64).tolist() for j, n in enumerate(engine.series_names)}}
