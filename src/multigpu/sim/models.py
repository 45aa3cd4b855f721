"""Shipped models and their substeps, registered by name (inside each rank).

Written against the same API as a user's model (:mod:`multigpu.sim.api`: a
model is agent fields, parameters, ``init`` and an ordered list of substeps,
each ``contribute`` / ``prepare`` / ``apply``). Because an agent's update
depends only on its own state, its own random numbers and exactly reduced
integer fields, the result does not depend on how agents are split over
ranks. Floats never enter a decision: probabilities are compared as 24-bit
integers against integer thresholds.

Models: ``movement`` (random walk on a periodic grid), ``sir`` (movement plus
infection from the infected count in the cell, or within ``radius`` cells;
``seir: true`` adds an exposed state), ``network_sir`` (SIR along the edges of
a contact network, :mod:`multigpu.sim.network`) and ``market`` (agents trade one asset;
the price moves with the exactly summed excess demand each step).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from multigpu.errors import ConfigError
from multigpu.sim import rng
from multigpu.sim.api import MODELS, SUBSTEPS, Context, Model, Substep, model_params, neighbourhood_sum, spawn_on_grid

__all__ = ["FUSED_KERNELS", "KERNELS", "MODELS", "SUBSTEPS", "Context", "Model", "Substep", "model_params", "move_apply",
           "sir_apply", "sir_contribute"]

S, E, I, R = 0, 1, 2, 3  # noqa: E741 - epidemic states (uint8), named as in the literature
FUNDAMENTALIST, CHARTIST, NOISE = 0, 1, 2  # market trader kinds (uint8)
_MAX_PRESSURE = 1 << 16  # infected counts above this are treated as this many (same on every split)


# ----------------------------------------------------------------------------- parameters
@dataclass(frozen=True, kw_only=True)
class MovementParams:
    move_prob: float = 0.5
    """Probability that an agent steps to one of its 4 neighbouring cells (periodic grid)."""


@dataclass(frozen=True, kw_only=True)
class SIRParams(MovementParams):
    beta: float = 0.05
    """Probability that one infected agent in reach infects a susceptible agent in a step."""
    gamma: float = 0.1
    """Recovery probability per step (I -> R)."""
    sigma: float = 0.2
    """SEIR only: probability per step that an exposed agent becomes infectious (E -> I)."""
    seir: bool = False
    """Add the exposed state: S -> E -> I -> R."""
    initial_infected: float = 0.001
    """Fraction of agents infected at step 0 (drawn per agent)."""
    radius: int = 0
    """Infection reach in cells: 0 = same cell, 1 = the 3x3 neighbourhood (needs a halo)."""


@dataclass(frozen=True, kw_only=True)
class MarketParams:
    activity: float = 0.1
    """Probability that an agent places an order in a step."""
    fundamentalists: float = 0.3
    """Share of agents trading towards the fundamental price."""
    chartists: float = 0.3
    """Share of agents following the last price move (the rest trade at random)."""
    fundamental_price: float = 100.0
    """The price fundamentalists believe in."""
    initial_price: float = 100.0
    """Price at step 0."""
    impact: float = 0.5
    """Log-price change per unit of excess demand as a share of all agents."""
    band: float = 0.01
    """Fundamentalists trade only when the log price is more than this away from the fundamental."""
    initial_cash: int = 1_000_000
    """Cash per agent at step 0, in price ticks (1/100 of a price unit)."""


def _check_prob(cls_name: str, p: Any) -> None:
    for f in dataclasses.fields(p):
        value = getattr(p, f.name)
        if isinstance(value, float) and f.name not in ("fundamental_price", "initial_price", "impact") \
                and not 0.0 <= value <= 1.0:
            raise ConfigError(f"sim.params.{f.name}={value} is invalid for {cls_name}; valid: a probability in [0, 1]")


def _check_builtin(p: Any) -> None:
    _check_prob(type(p).__name__, p)
    if isinstance(p, SIRParams) and p.radius not in (0, 1):
        raise ConfigError(f"sim.params.radius={p.radius} is invalid; valid: 0 or 1")
    if isinstance(p, MarketParams) and p.fundamentalists + p.chartists > 1.0:
        raise ConfigError("sim.params.fundamentalists + chartists must be <= 1 (the rest are noise traders)")


# ----------------------------------------------------------------------------- movement
def move_kernel(ids, x, y, key: int, move_thr: int, height: int, width: int):
    """One random-walk step, written into x and y: 16 bits decide whether to move, 2 bits where."""
    bits = rng.random_bits(ids, key)
    moving = (rng.low_bits(bits, 16) < move_thr).to(torch.int16)
    d = rng.low_bits(bits, 2, shift=16)
    dx = ((d == 0).to(torch.int16) - (d == 1).to(torch.int16)) * moving
    dy = ((d == 2).to(torch.int16) - (d == 3).to(torch.int16)) * moving
    nx, ny = x + dx, y + dy
    nx = torch.where(nx < 0, nx + width, torch.where(nx >= width, nx - width, nx))
    ny = torch.where(ny < 0, ny + height, torch.where(ny >= height, ny - height, ny))
    x.copy_(nx)  # in place: torch.compile writes straight into the agent buffers
    y.copy_(ny)
    return moving.sum(dtype=torch.int64)


def move_apply(ctx: Context, chunk, _prepared):
    """The built-in movement's ``apply`` (the engine knows it by identity: it fuses it with :func:`sir_contribute`)."""
    kernel = ctx.kernels["move"]
    moved = kernel(chunk["id"], chunk["x"], chunk["y"], ctx.key(rng.STREAM_MOVE),
                   rng.threshold(ctx.params.move_prob, 16), ctx.grid[0], ctx.grid[1])
    return moved.reshape(1)


SUBSTEPS["movement"] = Substep(
    "movement", ("id", "x", "y"), move_apply, moves=True, series=["moved"],
)
"""Random walk on the periodic grid with probability ``params.move_prob`` (the model's params need it)."""
MODELS["movement"] = Model(
    "movement", {"id": torch.int32, "x": torch.int16, "y": torch.int16}, ("movement",), MovementParams,
    init=lambda ctx, ids: spawn_on_grid(ids, ctx.seed, ctx.grid), check=_check_builtin,
)


# ----------------------------------------------------------------------------- sir / seir
def infected_kernel(acc, x, y, state, lo: int, width: int):
    """Add the infected agents per local cell into ``acc`` (int32, cells of rows lo, lo + 1, ...).

    The last slot of ``acc`` is a drop slot; agents outside the rows (about to
    migrate) are not counted here: the rank that receives them counts them.
    """
    ncells = acc.numel() - 1
    cell = (y.to(torch.int64) - lo) * width + x.to(torch.int64)
    mine = (state == I) & (cell >= 0) & (cell < ncells)
    acc.index_add_(0, cell[mine], torch.ones(int(mine.sum()), dtype=acc.dtype, device=acc.device))


def infected_kernel_fused(acc, x, y, state, lo: int, width: int):
    """:func:`infected_kernel` without the data-dependent selection, which torch.compile fuses into one loop.

    Every agent adds 1 (infected) or 0 into its own cell, so the adds spread over the cells as the agents do;
    only agents off this rank's rows go to the drop slot. Not ``index_put_(accumulate=True)`` into the drop
    slot for every uninfected agent: on a GPU that sorts the indices and adds each run of equal ones in one
    thread, so a step of 1e8 agents took seconds (the first GPU call, one H200: a warm-up step of 12 s).
    """
    ncells = acc.numel() - 1
    cell = (y.to(torch.int64) - lo) * width + x.to(torch.int64)
    inside = (cell >= 0) & (cell < ncells)
    acc.index_add_(0, torch.where(inside, cell, ncells), ((state == I) & inside).to(acc.dtype))


def move_count_kernel(ids, x, y, state, key: int, move_thr: int, height: int, width: int, acc, lo: int):
    """:func:`move_kernel`, then :func:`infected_kernel` of the moved agents into ``acc`` (the cells of rows
    ``lo, lo + 1, ...`` and the drop slot), then the positions of the agents outside those rows.

    One pass over the agents instead of three where it is native. Returns (agents moved, positions outside).
    """
    moved = move_kernel(ids, x, y, key, move_thr, height, width)
    infected_kernel(acc, x, y, state, lo, width)
    rows = (acc.numel() - 1) // width
    return moved, torch.nonzero((y < lo) | (y >= lo + rows)).reshape(-1)


def move_and_count(ctx: Context, chunk, acc: torch.Tensor):
    """The movement substep's ``apply`` and the sir substep's ``contribute`` at once: (moved [1], strays)."""
    moved, away = ctx.kernels["move_count"](chunk["id"], chunk["x"], chunk["y"], chunk["state"],
                                            ctx.key(rng.STREAM_MOVE), rng.threshold(ctx.params.move_prob, 16),
                                            ctx.grid[0], ctx.grid[1], acc, ctx.lo)
    return moved.reshape(1), away


def transition_kernel(ids, x, y, state, key: int, cell_thr, lo: int, width: int, state_thr, next_state):
    """Next epidemic state, written into ``state``: one 24-bit draw per agent against an integer threshold.

    Susceptible agents use their cell's infection threshold; E, I and R use
    ``state_thr`` (sigma, gamma, 0). The states are exclusive, so one draw serves all.
    """
    bits = rng.random_bits(ids, key)
    u = rng.low_bits(bits, 24, shift=8)
    s = state.to(torch.int64)
    cell = (y.to(torch.int64) - lo) * width + x.to(torch.int64)
    thr = torch.where(state == S, cell_thr[cell], state_thr[s])
    new = torch.where(u < thr, next_state[s], state)
    state.copy_(new)
    return torch.stack([(new == k).sum() for k in (S, E, I, R)])


def sir_contribute(ctx: Context, chunk, acc: torch.Tensor) -> None:
    """The built-in SIR's ``contribute``: each infected agent counted into its cell (fused after :func:`move_apply`)."""
    ctx.kernels["infected"](acc, chunk["x"], chunk["y"], chunk["state"], ctx.lo, ctx.grid[1])


def infection_table(beta: float) -> torch.Tensor:
    """int32 thresholds t[k] = floor((1 - (1 - beta)^k) * 2^24): P(infected by k infected agents).

    Computed with Python floats, the same way on every rank; it stops where it saturates.
    """
    values = []
    for k in range(_MAX_PRESSURE + 1):
        t = rng.threshold(1.0 - (1.0 - beta) ** k, 24)
        values.append(t)
        if t >= 1 << 24:
            break
    return torch.tensor(values, dtype=torch.int32)


pressure = neighbourhood_sum  # the built-in name (tests and benchmarks use it)


def _on_device(ctx: Context, name: str, device, make) -> torch.Tensor:
    """``make()`` (a CPU tensor of the parameters) on ``device``, made and copied once per run (kept in
    ``ctx.env``): a copy to a GPU every step would wait for the GPU each time."""
    key = f"_{name}@{torch.device(device)}"
    value = ctx.env.get(key)
    if value is None:
        value = ctx.env[key] = make().to(device)
    return value


def _table(ctx: Context, device) -> torch.Tensor:
    """``infection_table(beta)`` on ``device``, computed once per run."""
    return _on_device(ctx, "infection_table", device, lambda: infection_table(ctx.params.beta))


def thresholds_kernel(table, counts):
    """``table[min(count, len(table) - 1)]`` per cell: each cell's infection threshold (int32, flat)."""
    return table[counts.reshape(-1).clamp(max=table.numel() - 1)]


def _sir_prepare(ctx: Context, counts: torch.Tensor):
    p = ctx.params
    table = _table(ctx, counts.device)
    cell_thr = ctx.kernels.get("thresholds", thresholds_kernel)(table, pressure(counts, p.radius))
    state_thr = _on_device(ctx, "state_thresholds", counts.device, lambda: torch.tensor(
        [0, rng.threshold(p.sigma), rng.threshold(p.gamma), 0], dtype=torch.int32))
    next_state = _on_device(ctx, "next_state", counts.device,
                            lambda: torch.tensor([E if p.seir else I, I, R, R], dtype=torch.uint8))
    return cell_thr, state_thr, next_state


def sir_apply(ctx: Context, chunk, prepared):
    """The built-in SIR's ``apply``: each agent's transition, the counts per state returned (run whole, unchunked)."""
    cell_thr, state_thr, next_state = prepared
    counts = ctx.kernels["transition"](chunk["id"], chunk["x"], chunk["y"], chunk["state"],
                                       ctx.key(rng.STREAM_TRANSITION), cell_thr, ctx.lo, ctx.grid[1],
                                       state_thr, next_state)
    return counts if ctx.params.seir else torch.cat([counts[S : S + 1], counts[I:]])  # S, I, R: no index from the host


def _sir_init(ctx: Context, ids):
    agents = spawn_on_grid(ids, ctx.seed, ctx.grid)
    u = rng.low_bits(rng.random_bits(ids, rng.step_key(ctx.seed, -1, 12)), 24, shift=8)
    agents["state"] = torch.where(u < rng.threshold(ctx.params.initial_infected), I, S).to(torch.uint8)
    return agents


SUBSTEPS["sir"] = Substep(
    "sir", ("id", "x", "y", "state"), sir_apply, field="cell", contribute=sir_contribute,
    prepare=_sir_prepare, series=lambda p: ["S", "E", "I", "R"] if p.seir else ["S", "I", "R"],
    halo=lambda p: p.radius,
)
def _epidemic_states(p: Any) -> dict[str, dict[int, str]]:
    """The states a population file may give: E only where the model has it (SEIR)."""
    states = {S: "S", E: "E", I: "I", R: "R"} if getattr(p, "seir", False) else {S: "S", I: "I", R: "R"}
    return {"state": states}


MODELS["sir"] = Model(
    "sir", {"id": torch.int32, "x": torch.int16, "y": torch.int16, "state": torch.uint8},
    ("movement", "sir"), SIRParams, init=_sir_init, check=_check_builtin, learnable=("beta",), values=_epidemic_states,
)


# ----------------------------------------------------------------------------- sir on a contact network
@dataclass(frozen=True, kw_only=True)
class NetworkSIRParams:
    beta: float = 0.05
    """Probability that one infected neighbour infects a susceptible agent in a step."""
    gamma: float = 0.1
    """Recovery probability per step (I -> R)."""
    initial_infected: float = 0.001
    """Fraction of agents infected at step 0 (drawn per agent)."""


def _net_infected(ctx: Context, agents):
    return (agents["state"] == I).to(torch.int32)


def _net_prepare(ctx: Context, inbox: torch.Tensor):
    """Per agent: the threshold of being infected by its ``inbox`` infected neighbours."""
    table = _table(ctx, inbox.device)
    return table[inbox.clamp(max=table.numel() - 1)]


def net_transition_kernel(ids, state, thr, key: int, recover: int):
    """network_sir's transition of each agent (``state`` updated in place): S -> I where its draw is under its
    infection threshold ``thr``, I -> R under ``recover``; returns the counts of S, I and R after it."""
    u = rng.low_bits(rng.random_bits(ids, key), 24, shift=8)
    new = torch.where((state == S) & (u < thr), I, torch.where((state == I) & (u < recover), R, state))
    state.copy_(new.to(torch.uint8))
    return torch.stack([(state == k).sum() for k in (S, I, R)])


def _net_apply(ctx: Context, agents, thr):
    step = ctx.kernels.get("net_transition", net_transition_kernel)
    return step(agents["id"], agents["state"], thr, ctx.key(rng.STREAM_TRANSITION), rng.threshold(ctx.params.gamma))


def _net_init(ctx: Context, ids):
    u = rng.low_bits(rng.random_bits(ids, rng.step_key(ctx.seed, -1, 12)), 24, shift=8)
    return {"id": ids, "state": torch.where(u < rng.threshold(ctx.params.initial_infected), I, S).to(torch.uint8)}


SUBSTEPS["network_sir"] = Substep(
    "network_sir", ("id", "state"), _net_apply, field="network", contribute=_net_infected, prepare=_net_prepare,
    series=["S", "I", "R"],
)
MODELS["network_sir"] = Model(
    "network_sir", {"id": torch.int32, "state": torch.uint8}, ("network_sir",), NetworkSIRParams, init=_net_init,
    check=_check_builtin, values=_epidemic_states,
)


# ----------------------------------------------------------------------------- market
def decide_kernel(ids, kind, key: int, act_thr: int, kind_order):
    """Each active agent's order (-1, 0, +1): fundamentalists and chartists by rule, noise at random."""
    bits = rng.random_bits(ids, key)
    active = rng.low_bits(bits, 24) < act_thr
    coin = (rng.low_bits(bits, 1, shift=24) * 2 - 1).to(torch.int8)
    rule = kind_order[kind.to(torch.int64)]
    return torch.where(active, torch.where(kind == NOISE, coin, rule), torch.zeros_like(rule))


def _sign(v: float) -> int:
    return (v > 0) - (v < 0)


def _decide_apply(ctx: Context, chunk, _prepared):
    p, env = ctx.params, ctx.env
    gap = math.log(p.fundamental_price) - env["log_price"]
    fund = _sign(gap) if abs(gap) > p.band else 0
    chart = _sign(env["log_price"] - env["prev_log_price"])
    # filled on the device: a table copied from the host would wait for the GPU, once per chunk
    table = torch.zeros(3, dtype=torch.int8, device=chunk["id"].device)
    table[FUNDAMENTALIST], table[CHARTIST] = fund, chart
    chunk["order"].copy_(ctx.kernels["decide"](chunk["id"], chunk["kind"], ctx.key(rng.STREAM_MARKET),
                                           rng.threshold(p.activity), table))


def _trade_contribute(ctx: Context, chunk, acc: torch.Tensor) -> None:
    o = chunk["order"].to(torch.int64)
    acc += torch.stack([o.sum(), o.abs().sum(), (o > 0).sum(), (o < 0).sum()])


def _trade_prepare(ctx: Context, sums: torch.Tensor):
    """New price from the exactly summed excess demand: the same float ops on every rank."""
    env, p = ctx.env, ctx.params
    demand, volume, buyers, sellers = (int(v) for v in sums.tolist())
    env["prev_log_price"] = env["log_price"]
    env["log_price"] = env["log_price"] + p.impact * demand / ctx.num_agents
    price = math.exp(env["log_price"])
    env["series"] = {"price": price, "demand": demand, "volume": volume, "buyers": buyers, "sellers": sellers}
    return round(price * 100)  # ticks


def _trade_apply(ctx: Context, chunk, ticks: int):
    o = chunk["order"]
    chunk["position"].add_(o.to(torch.int32))
    chunk["cash"].sub_(o.to(torch.int64) * ticks)


def _market_init(ctx: Context, ids):
    p = ctx.params
    u = rng.low_bits(rng.random_bits(ids, rng.step_key(ctx.seed, -1, 13)), 24, shift=8)
    kind = torch.where(u < rng.threshold(p.fundamentalists), FUNDAMENTALIST,
                       torch.where(u < rng.threshold(p.fundamentalists + p.chartists), CHARTIST, NOISE))
    n = ids.shape[0]
    dev = ids.device
    return {"id": ids.to(torch.int32), "kind": kind.to(torch.uint8), "order": torch.zeros(n, dtype=torch.int8, device=dev),
            "position": torch.zeros(n, dtype=torch.int32, device=dev),
            "cash": torch.full((n,), p.initial_cash, dtype=torch.int64, device=dev)}


SUBSTEPS["decide"] = Substep("decide", ("id", "kind", "order"), _decide_apply)
SUBSTEPS["trade"] = Substep(
    "trade", ("order", "position", "cash"), _trade_apply, field="global", field_size=4,
    contribute=_trade_contribute,
    prepare=_trade_prepare, globals=lambda p: ["price", "demand", "volume", "buyers", "sellers"],
)
MODELS["market"] = Model(
    "market", {"id": torch.int32, "kind": torch.uint8, "order": torch.int8, "position": torch.int32,
               "cash": torch.int64},
    ("decide", "trade"), MarketParams, init=_market_init, spatial=False, check=_check_builtin,
    env=lambda p: {"log_price": math.log(p.initial_price), "prev_log_price": math.log(p.initial_price)},
)

KERNELS = {"move": move_kernel, "infected": infected_kernel, "transition": transition_kernel,
           "decide": decide_kernel, "move_count": move_count_kernel, "thresholds": thresholds_kernel}
"""The per-chunk kernels; the engine wraps them in torch.compile when ``compile: true``."""
FUSED_KERNELS = {"infected": infected_kernel_fused}
"""Replacements that compile better (same integer results)."""
