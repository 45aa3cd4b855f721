"""Write your own model: agent fields, parameters, ``init`` and an ordered list of substeps (inside each rank).

A *model* is what one agent is (its fields, each a name and a torch dtype),
its parameters (a frozen dataclass: ``params.x=...`` on the command line),
``init(ctx, ids)`` (the agents' first state, from their ids) and the
*substeps* each step runs in order. A *substep* is up to three vectorized
functions of (agents, fields, random numbers, parameters):

* ``contribute(ctx, agents, acc)``: add these agents' share of a *field* into
  ``acc``, an integer tensor the engine made: per grid cell (``field="cell"``,
  ``[cells]`` or ``[cells, channels]``, int32) or a few global sums
  (``field="global"``, ``[field_size]``, int64);
* ``prepare(ctx, field)``: once per step, after the field was summed over
  every rank, turn it into what the agents look up (default: the field itself);
* ``apply(ctx, agents, prepared)``: update ``agents`` (a dict of views) in
  place; may return an int64 vector of per-step sums (the ``series``).

    import torch
    from dataclasses import dataclass
    from multigpu.sim import Model, Substep

    @dataclass(frozen=True, kw_only=True)
    class Params:
        p_flip: float = 0.1

    def init(ctx, ids):
        return {"id": ids, "bit": ctx.bernoulli(ids, 0.5, "init").to(torch.uint8)}

    def flip(ctx, agents, _):
        agents["bit"] ^= ctx.bernoulli(agents["id"], ctx.params.p_flip, "flip").to(torch.uint8)
        return agents["bit"].sum(dtype=torch.int64).reshape(1)

    MODEL = Model(name="flips", fields={"id": torch.int32, "bit": torch.uint8}, params=Params, init=init,
                  substeps=[Substep("flip", apply=flip, series=["ones"])])

    # multigpu sim --model mypkg.flips:MODEL params.p_flip=0.2 --agents 1_000_000 --check-split

The rules that make a model's result independent of the split (``--check-split``
runs it on 1 and 2 ranks and names the first substep and field that differ):

1. randomness only from ``ctx.random_bits / uniform / bernoulli / randint(ids, ..., stream)``:
   counter-based numbers keyed by (seed, agent id, step, stream), never ``torch.rand``;
   one stream name per decision;
2. an agent's update reads only its own fields, its own random numbers, the
   prepared fields and ``ctx.env``; never another row of the chunk, the chunk's
   size, its position, or the rank;
3. what crosses agents goes through a field: integer sums, exact in any order
   (a float sum depends on the order of the additions, so fields are integers);
4. decisions compare integers (``ctx.bernoulli`` compares 24-bit integers with
   an integer threshold); floats are fine inside one agent's own update.

The rules of the spatial strategies (agents live on the rank that owns their grid row):

5. a substep that changes ``x`` or ``y`` is marked ``moves=True`` (the engine then sends
   agents that left this rank's rows to their new owner); a substep without it that
   leaves agents outside this rank's rows stops the run with "substep 'walk' moved
   agents but is not marked moves=True"; positions stay on the grid (wrap them);
6. a cell field's ``acc`` is ``[rows * width + 1]`` (or ``[rows * width + 1, channels]``):
   this rank's cells, row-major from row ``ctx.lo``, and one *drop slot* at the end.
   ``contribute`` may see agents that just left this rank's rows (the rank that
   receives them counts them); they go to the drop slot. ``ctx.cell(agents)`` does
   this (an agent outside the rows gets ``rows * width``), so use it. To count only
   some agents, add 0 or 1 into each agent's own cell (``acc.index_add_(0, cell, flag)``)
   rather than sending the others to one index: a GPU adds the equal indices of an
   accumulating ``index_put_`` one after another (seconds per step at 1e8 agents);
7. ``prepare`` of a cell field gets ``[rows + 2 * halo, width]`` (plus ``channels``):
   this rank's rows with ``halo`` rows of the neighbours above and below (periodic
   in y over the whole grid), summed over every rank; :func:`neighbourhood_sum`
   turns it into the sum within ``halo`` cells (periodic in x), ``[rows, width, ...]``,
   which ``ctx.cell(agents)`` indexes once flattened to ``[rows * width, ...]``.

And one of every strategy:

8. ``apply`` runs once per chunk of agents, and its sums (``series``) are added over
   chunks and ranks, so it returns its own agents' share; a value every rank already
   holds (a global count from a "global" field's ``prepare``) would be counted once per
   chunk and rank (twice on 2 ranks): store it in ``ctx.env["series"]`` in ``prepare``
   and name it in ``globals=`` instead (``--check-split`` says when a series is a
   multiple of the 1-rank one).

Built-in substeps (``"movement"``, ``"sir"``, ...) can be named in ``substeps``.
A spatial model (fields ``x`` and ``y``, int16) can use every strategy; others use ``data``.

Calibration (``--calibrate SERIES.csv``, :mod:`multigpu.sim.calibration`) learns any float
parameter (``Model(learnable=[...])`` or ``calibrate.learn``) by gradient descent. The same
substeps run differentiably when they decide with ``ctx.bernoulli(ids, p, stream)`` where ``p``
is a tensor (a learned parameter, or computed from one: straight-through), keep what carries
the gradient in float fields, and add fields as ``values.to(acc.dtype)``; see
:mod:`multigpu.sim.differentiable` and ``examples/sim_rumour.py``.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from multigpu.errors import ConfigError
from multigpu.sim import rng

__all__ = ["FIELD_KINDS", "MODELS", "SUBSTEPS", "Context", "Model", "NoParams", "Substep", "float_params", "get_model",
           "model_params", "neighbourhood_sum", "register_model", "spawn_on_grid", "stream_id"]

FIELD_KINDS = (None, "cell", "global", "network")
"""What a substep's field is: none, per grid cell, a few global sums, or per agent over a contact network."""

_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.float32, torch.float64)


def stream_id(stream: int | str) -> int:
    """The integer stream of ``stream``: an int as it is, a name by CRC-32 (plus 2**32, apart from the ints)."""
    if isinstance(stream, str):
        return (1 << 32) + zlib.crc32(stream.encode())
    if isinstance(stream, int) and not isinstance(stream, bool) and stream >= 0:
        return stream
    raise ValueError(f"random stream {stream!r} is invalid; valid: an int >= 0 or a name")


@dataclass
class Context:
    """What a substep may read besides its agents: the step, parameters, grid, this rank's field rows."""

    seed: int
    step: int
    """The step being computed (0 first); -1 in ``init``."""
    params: Any
    grid: tuple[int, int]
    lo: int = 0
    """First grid row of this rank's cell field (0 for the data strategy)."""
    rows: int = 0
    """Grid rows of this rank's cell field (all rows for the data strategy)."""
    kernels: dict[str, Callable] = field(default_factory=dict)
    """The built-in per-chunk kernels (eager, or torch.compile'd)."""
    num_agents: int = 0
    """Agents in the whole simulation (all ranks)."""
    env: dict[str, Any] = field(default_factory=dict)
    """Global values every rank keeps identical (the market price); ``prepare`` may update them."""

    def key(self, stream: int | str) -> int:
        """The 32-bit key of (seed, step, stream)."""
        return rng.step_key(self.seed, self.step, stream_id(stream))

    # ---------------------------------------------------------------- counter-based random numbers
    def random_bits(self, ids: torch.Tensor, stream: int | str) -> torch.Tensor:
        """32 random bits (int32) per agent id, a function of (seed, id, step, stream) only."""
        return rng.random_bits(ids, self.key(stream))

    def uniform(self, ids: torch.Tensor, stream: int | str) -> torch.Tensor:
        """A float32 in [0, 1) per agent (24 random bits; for continuous updates, not for decisions)."""
        return rng.uniform(self.random_bits(ids, stream))

    def bernoulli(self, ids: torch.Tensor, p: float | torch.Tensor, stream: int | str) -> torch.Tensor:
        """True with probability ``p`` per agent, decided on integers (exact on every rank).

        ``p`` is a float, or an int32 tensor of 24-bit thresholds (``rng.threshold(p)`` per agent), or a
        floating tensor of probabilities (per agent, or one learned parameter). A floating tensor gives floats
        0/1 with the straight-through gradient (AgentTorch's choice): hard decisions forward, d decision / d p
        = 1 backward, so a substep written with it is differentiable in calibration without autograd code.
        """
        u = rng.low_bits(self.random_bits(ids, stream), 24, shift=8)
        if isinstance(p, torch.Tensor) and p.is_floating_point():
            p = p.to(torch.float64)
            hard = (u.to(torch.float64) * (1.0 / (1 << 24)) < p).to(p.dtype)
            return hard + p - p.detach()  # the value of hard; the gradient of p
        return u < (rng.threshold(p) if isinstance(p, (int, float)) else p)

    def categorical(self, ids: torch.Tensor, probs: torch.Tensor, stream: int | str) -> torch.Tensor:
        """One choice per agent among ``probs.shape[1]`` (rows of probabilities summing to 1), one-hot float64.

        Straight-through as :meth:`bernoulli`: the one-hot choice forward, the gradient of ``probs``
        backward (a relaxed ``randint`` is ``categorical`` with equal probabilities). Decided by the agent's
        own uniform number against the running sum of its row.
        """
        probs = probs.to(torch.float64)
        u = rng.low_bits(self.random_bits(ids, stream), 24, shift=8).to(torch.float64) * (1.0 / (1 << 24))
        below = (probs.detach().cumsum(1) <= u[:, None]).sum(1).clamp(max=probs.shape[1] - 1)
        hard = torch.nn.functional.one_hot(below, probs.shape[1]).to(probs.dtype)
        return hard + probs - probs.detach()

    def randint(self, ids: torch.Tensor, n: int | torch.Tensor, stream: int | str) -> torch.Tensor:
        """An int64 in [0, n) per agent (``n`` < 2**31; a tensor gives one bound per agent)."""
        u31 = (self.random_bits(ids, stream) & 0x7FFFFFFF).to(torch.int64)
        return (u31 * n) >> 31

    # ---------------------------------------------------------------- grid helpers
    def cell(self, agents: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each agent's index into this rank's cell field (int64), from its ``x`` and ``y``.

        An agent outside this rank's rows (it just moved away; ``contribute`` may see it) gets the drop
        slot ``rows * width``, the last slot of a cell field's ``acc``: no other rank's cell is counted here.
        """
        y = agents["y"].to(torch.int64) - self.lo
        cell = y * self.grid[1] + agents["x"].to(torch.int64)
        return torch.where((y >= 0) & (y < self.rows), cell, self.rows * self.grid[1])


def neighbourhood_sum(field: torch.Tensor, radius: int) -> torch.Tensor:
    """Sum of a cell field within ``radius`` cells, periodic in x: the 3x3 neighbourhood for radius 1.

    ``field`` is what a cell field's ``prepare`` gets, ``[rows + 2 * radius, width, ...]`` (halo rows
    included); returns ``[rows, width, ...]``, this rank's rows. Integer sums: exact on any split.
    """
    if radius == 0:
        return field
    rows = field.shape[0] - 2 * radius
    total = torch.zeros((rows, *field.shape[1:]), dtype=field.dtype, device=field.device)
    for dy in range(2 * radius + 1):
        band = field[dy : dy + rows]
        for dx in range(-radius, radius + 1):
            total += torch.roll(band, dx, dims=1)
    return total


def spawn_on_grid(ids: torch.Tensor, seed: int, grid: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``id``, ``x`` and ``y`` of agents placed uniformly at random on the grid (a function of seed and id)."""
    bx = rng.random_bits(ids, rng.step_key(seed, -1, 10)) & 0x7FFFFFFF
    by = rng.random_bits(ids, rng.step_key(seed, -1, 11)) & 0x7FFFFFFF
    return {"id": ids.to(torch.int32), "x": (bx % grid[1]).to(torch.int16), "y": (by % grid[0]).to(torch.int16)}


@dataclass(frozen=True, kw_only=True)
class NoParams:
    """A model without parameters."""


def _as_names(value: Any) -> Callable[[Any], list[str]]:
    if callable(value):
        return value
    names = [str(v) for v in value]
    return lambda params: names


def _as_count(value: Any) -> Callable[[Any], int]:
    if callable(value):
        return value
    count = int(value)
    return lambda params: count


@dataclass(frozen=True)
class Substep:
    """One piece of a step; see the module docstring. ``needs`` lists the agent fields it reads or writes."""

    name: str
    needs: tuple[str, ...] = ()
    """Agent fields the substep reads or writes (checked against the model's fields)."""
    apply: Callable[[Context, dict[str, torch.Tensor], Any], torch.Tensor | None] | None = None
    field: str | None = None
    """None, "cell" (an integer per grid cell and channel), "global" (``field_size`` int64 sums) or "network"
    (per agent, the sum over its neighbours of what ``contribute`` returns; see :mod:`multigpu.sim.network`)."""
    contribute: Callable | None = None
    """cell/global: ``contribute(ctx, agents, acc)`` adds into ``acc`` in place. network:
    ``contribute(ctx, agents)`` returns each agent's integer message [n] or [n, channels]."""
    prepare: Callable[[Context, torch.Tensor], Any] | None = None
    """``prepare(ctx, field)``: once per step, from the summed field (default: the field as it is)."""
    field_size: int = 0
    """Length of a "global" field."""
    channels: Callable[[Any], int] | int = 1
    """Integers per cell of a "cell" field, or per agent of a "network" field (1: a flat tensor; a number,
    or a function of the parameters)."""
    moves: bool = False
    """Agents may change cell (spatial strategies migrate them afterwards)."""
    series: Callable[[Any], list[str]] | Sequence[str] = ()
    """Names of the int64 sums ``apply`` returns (a list, or a function of the parameters)."""
    globals: Callable[[Any], list[str]] | Sequence[str] = ()
    """Names of the global values ``prepare`` stores in ``ctx.env['series']``."""
    halo: Callable[[Any], int] | int = 0
    """Rows of neighbouring cells a "cell" field needs (the interaction radius)."""

    def __post_init__(self) -> None:
        where = f"sim substep {self.name!r}"
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(f"sim substep name {self.name!r} is invalid; valid: a Python identifier")
        if not callable(self.apply):
            raise ConfigError(f"{where} has no apply function; give apply=fn(ctx, agents, prepared)")
        if self.field not in FIELD_KINDS:
            raise ConfigError(f"{where}: field={self.field!r} is invalid; valid: None, cell, global, network")
        if self.field and not callable(self.contribute):
            raise ConfigError(f"{where} reads a {self.field} field but has no contribute function")
        if self.field == "global" and self.field_size < 1:
            raise ConfigError(f"{where}: a global field needs field_size >= 1")
        if not callable(self.channels) and not (isinstance(self.channels, int) and self.channels >= 1):
            raise ConfigError(f"{where}: channels={self.channels!r} is invalid; valid: an int >= 1")
        object.__setattr__(self, "needs", tuple(self.needs))
        object.__setattr__(self, "series", _as_names(self.series))
        object.__setattr__(self, "globals", _as_names(self.globals))
        object.__setattr__(self, "halo", _as_count(self.halo))
        object.__setattr__(self, "channels", _as_count(self.channels))
        if self.prepare is None:
            object.__setattr__(self, "prepare", lambda ctx, f: f)


def float_params(params: type) -> list[str]:
    """The fields of a parameter dataclass whose default is a float: what calibration can learn."""
    return [f.name for f in dataclasses.fields(params)
            if isinstance(f.default, float) and not isinstance(f.default, bool)]


SUBSTEPS: dict[str, Substep] = {}
"""The built-in substeps by name (``"movement"``, ``"sir"``, ...), usable in any model's ``substeps``."""


@dataclass(frozen=True)
class Model:
    """A simulation model; see the module docstring. Construction checks it (one-line ConfigError)."""

    name: str
    fields: Mapping[str, torch.dtype]
    """Agent fields: name -> dtype. ``id`` (int32) is required; ``x`` and ``y`` (int16) make it spatial."""
    substeps: Sequence[str | Substep]
    """The default substeps, in order: Substep objects or names of built-in ones."""
    params: type = NoParams
    """A frozen dataclass of parameters (``params.name=value`` overrides)."""
    init: Callable[[Context, torch.Tensor], dict[str, torch.Tensor]] | None = None
    """``init(ctx, ids)`` -> every field for agents ``ids`` (int32); ctx.step is -1."""
    spatial: bool | None = None
    """Agents live on grid cells (default: the fields have ``x`` and ``y``)."""
    env: Callable[[Any], dict[str, Any]] = lambda params: {}
    """Global values at step 0 (``ctx.env``), from the parameters."""
    check: Callable[[Any], None] | None = None
    """``check(params)`` raises ConfigError for parameter values the model cannot use."""
    learnable: Sequence[str] = ()
    """Float parameters that calibration learns unless ``calibrate.learn`` names others (AgentTorch's
    ``learnable: true``); any float field of ``params`` can be learned."""
    values: Callable[[Any], Mapping[str, Mapping[int, str]]] | None = None
    """``values(params)`` -> ``{field: {value: name}}``: the only values those integer fields may hold (the
    built-in SIR's ``state``: S, I, R, and E with ``seir``). A population file holding another is refused."""

    def __post_init__(self) -> None:
        where = f"sim model {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"sim model name {self.name!r} is invalid; valid: a non-empty string")
        fields = dict(self.fields)
        for name, dtype in fields.items():
            if not isinstance(name, str) or not name.isidentifier() or dtype not in _DTYPES:
                raise ConfigError(f"{where}: field {name!r}: {dtype!r} is invalid; valid: an identifier -> "
                                  f"one of {', '.join(str(d).removeprefix('torch.') for d in _DTYPES)}")
        if fields.get("id") is not torch.int32:
            raise ConfigError(f"{where} needs an 'id' field of dtype torch.int32 (agent ids key the random numbers)")
        spatial = self.spatial if self.spatial is not None else ("x" in fields and "y" in fields)
        if spatial and (fields.get("x") is not torch.int16 or fields.get("y") is not torch.int16):
            raise ConfigError(f"{where} is spatial, so it needs fields 'x' and 'y' of dtype torch.int16")
        if not callable(self.init):
            raise ConfigError(f"{where} has no init function; give init=fn(ctx, ids) -> {{field: tensor}}")
        if not (isinstance(self.params, type) and dataclasses.is_dataclass(self.params)):
            raise ConfigError(f"{where}: params must be a dataclass class, got {self.params!r}")
        if isinstance(self.substeps, (str, Substep)) or not self.substeps:
            raise ConfigError(f"{where} needs a list of substeps (Substep objects or built-in names)")
        bad = [n for n in self.learnable if n not in float_params(self.params)]
        if isinstance(self.learnable, str) or bad:
            raise ConfigError(f"{where}: learnable={list(self.learnable) if not isinstance(self.learnable, str) else self.learnable!r} "
                              f"is invalid; valid: float fields of {self.params.__name__}: "
                              f"{', '.join(float_params(self.params)) or 'none'}")
        object.__setattr__(self, "learnable", tuple(self.learnable))
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "spatial", spatial)
        steps = tuple(self._resolve(s) for s in self.substeps)
        names = [s.name for s in steps]
        if len(set(names)) != len(names):
            raise ConfigError(f"{where}: substep names repeat ({', '.join(names)}); give each its own name")
        object.__setattr__(self, "substeps", steps)

    def _resolve(self, step: str | Substep) -> Substep:
        if isinstance(step, str):
            if step not in SUBSTEPS:
                raise ConfigError(f"sim model {self.name!r}: unknown substep {step!r}; valid: a Substep, or "
                                  f"{', '.join(sorted(SUBSTEPS))}")
            step = SUBSTEPS[step]
        if not isinstance(step, Substep):
            raise ConfigError(f"sim model {self.name!r}: substep {step!r} is a {type(step).__name__}, not a Substep")
        self.check_substep(step)
        return step

    def check_substep(self, step: Substep) -> None:
        """ConfigError when ``step`` cannot run in this model (fields it needs, grid it needs)."""
        missing = sorted(set(step.needs) - set(self.fields))
        if missing:
            raise ConfigError(f"sim.substeps: {step.name!r} needs agent fields {missing} "
                              f"that model {self.name!r} does not have")
        if (step.field == "cell" or step.moves) and not self.spatial:
            raise ConfigError(f"sim.substeps: {step.name!r} works on grid cells, but model {self.name!r} "
                              "has no positions (fields x, y)")

    @property
    def substep_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.substeps)

    def substep(self, name: str) -> Substep:
        """One of this model's substeps, else a built-in one, by name."""
        for s in self.substeps:
            if s.name == name:
                return s
        valid = sorted(set(self.substep_names) | set(SUBSTEPS))
        if name not in SUBSTEPS:
            raise ConfigError(f"sim.substeps: unknown substep {name!r}; valid: {', '.join(valid)}")
        step = SUBSTEPS[name]
        self.check_substep(step)
        return step


MODELS: dict[str, Model] = {}
"""Models by name: the built-in ones and those given to :func:`register_model`."""
_IMPORTED: dict[str, Model] = {}


def register_model(model: Model | Callable[[], Model]) -> Model:
    """Make ``model`` known by its name (``SimConfig(model="name")``); usable as a decorator on a factory.

    Raises ConfigError when another model already has the name.
    """
    if not isinstance(model, Model):
        model = model()
    if not isinstance(model, Model):
        raise ConfigError(f"register_model got a {type(model).__name__}; valid: a multigpu.sim.Model")
    other = MODELS.get(model.name)
    if other is not None and other is not model:
        raise ConfigError(f"sim model name {model.name!r} is taken; give your model another name")
    MODELS[model.name] = model
    return model


def get_model(spec: str) -> Model:
    """A model by name (built-in or registered) or ``pkg.module:NAME`` (a Model, or a function returning one).

    Importing the module runs its code, as ``python -m`` would: name only modules you trust.
    """
    if spec in MODELS:
        return MODELS[spec]
    if spec in _IMPORTED:
        return _IMPORTED[spec]
    if ":" not in str(spec):
        raise ConfigError(f"sim.model {spec!r} is not a known model; valid: {', '.join(sorted(MODELS))}, "
                          "or pkg.module:MODEL")
    from multigpu.factory import import_object

    obj = import_object(spec, what="sim.model")
    if not isinstance(obj, Model) and callable(obj) and not isinstance(obj, type):
        try:
            obj = obj()
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's factory can fail in any way
            raise ConfigError(f"sim.model {spec!r}: calling it failed: {type(exc).__name__}: {exc}") from None
    if not isinstance(obj, Model):
        raise ConfigError(f"sim.model {spec!r} is of type {type(obj).__name__}; valid: a multigpu.sim.Model, "
                          "or a function returning one")
    _IMPORTED[spec] = obj
    return obj


def model_params(model: Model | str, params: Mapping[str, Any] | None) -> Any:
    """The model's parameter dataclass from ``params``, rejecting unknown names with a suggestion."""
    from multigpu.config import from_dict

    model = get_model(model) if isinstance(model, str) else model
    p = from_dict(model.params, params or {}, prefix="sim.params")
    if model.check is not None:
        model.check(p)
    return p
