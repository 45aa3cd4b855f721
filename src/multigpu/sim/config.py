"""``SimConfig``: what one simulation run is (read on both sides of the launch).

Loaded from YAML plus ``key=value`` overrides with :func:`multigpu.config.load_config`;
everything a user can get wrong fails here, in the launcher, with one line::

    cfg = load_config(SimConfig, "sir.yaml", ["agents=10_000_000", "params.beta=0.08"])

Model parameters (``params``) are checked against the chosen model's own
parameter class (:mod:`multigpu.sim.models`), so ``params.bata`` gets a
"did you mean 'params.beta'".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from multigpu.errors import ConfigError
from multigpu.sim.calibration_config import CalibrateConfig, check_learning
from multigpu.sim.design import EnsembleConfig
from multigpu.sim.network import NetworkConfig

__all__ = ["MAX_AGENTS", "STRATEGIES", "WORKING_BYTES_FACTOR", "SimConfig"]

MAX_AGENTS = 2**31 - 1
"""Agent ids are int32 (4 bytes of every agent's state), so a run holds at most this many agents."""

WORKING_BYTES_FACTOR = 4
"""Peak memory per agent, as a multiple of its state's bytes: buffers grow by 1.25x, a growing buffer is
copied, sorting and migration take copies (measured: SIR, 9 bytes of state, peak RSS +34-40 bytes per agent
from 1M to 8M agents on one CPU rank)."""

CELL_BYTES = 12
"""Memory per grid cell a rank holds (the int32 cell field, its per-cell thresholds, the accumulator)."""

STRATEGIES = ("data", "spatial", "adaptive")
"""Ways to split the work: by agent id, by grid region, by grid region with moving borders."""

_STRATEGY_ALIASES = {"data_parallel": "data", "spatial_parallel": "spatial"}


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    model: str = "sir"
    """A built-in model (movement, sir, network_sir, market), a registered one, or ``pkg.module:MODEL`` (a
    :class:`multigpu.sim.Model`, or a function returning one; importing the module runs its code)."""

    agents: int = 1_000_000
    """Global number of agents (multiplied by world_size under weak scaling)."""

    grid: tuple[int, ...] = (1000, 1000)
    """Grid size [height, width] in cells; agents live on cells (models with positions only)."""

    steps: int = 100
    """Simulation steps to run."""

    strategy: str = "data"
    """data (agents split by id, cell fields all-reduced), spatial (grid rows split into strips,
    agents migrate across borders) or adaptive (spatial with borders moved to balance agents)."""

    sync_frequency: int = 1
    """data strategy: all-reduce the cell fields every k steps and use stale fields in between.
    Only 1 gives results independent of the split; k > 1 is an approximation."""

    rebalance_every: int = 10
    """adaptive strategy: move the strip borders every K steps."""

    seed: int = 0
    """Seed of the counter-based random numbers (keyed by seed, agent id, step, stream)."""

    substeps: tuple[str, ...] = ()
    """Substeps to run each step, in order; empty: the model's default list."""

    params: dict[str, Any] = field(default_factory=dict)
    """Model parameters (e.g. beta, gamma for sir); unknown names are rejected."""

    checkpoint_every: int = 0
    """Save the sharded agent state every K steps (0: never)."""

    keep_last: int = 3
    """Checkpoints kept in ``<run_dir>/checkpoints``; older ones are deleted after each save."""

    checkpoint_mode: Literal["async", "sync"] = "async"
    """async: the agents are copied to host memory and written in the background while the simulation goes
    on; sync: every rank waits until the checkpoint is on disk (where the host cannot hold one more copy)."""

    checkpoint_on_interrupt: bool = False
    """On Ctrl-C or SIGTERM (a pre-emption), finish the current step, write its checkpoint and stop (exit 130 or
    143); ``--resume auto`` continues from it."""

    chunk_size: int = 1 << 18
    """Agents processed per vectorized chunk: bounds the step temporaries (the built-in movement and SIR on the C
    kernels, which keep none per agent, take all of a rank's agents in one call)."""

    sort_every: int = 20
    """Reorder this rank's agents by grid row every K steps (0: never). Only memory locality
    changes (cell lookups hit the cache); results do not depend on agent order."""

    compile: bool = False
    """Fuse the per-chunk kernels with torch.compile (measure before keeping it on)."""

    overlap: str | bool = "auto"
    """Start the migration all-to-alls and the series all-reduce asynchronously and do the local work that
    does not need them meanwhile (the same results): auto (off: measured no gain on gloo CPU ranks; see
    benchmarks/history/simulation.md), on, off."""

    native: str | bool = "auto"
    """The built-in movement / SIR kernels as C loops compiled on first use (:mod:`multigpu.sim.native`; the
    same results as the torch kernels): auto (where a C compiler works, else the torch kernels), on, off."""

    backend: str = "auto"
    """Device backend for the ranks: auto, cuda or cpu."""

    log_every: int = 10
    """Reduce the aggregates and meter figures every N steps."""

    plot: bool = True
    """Rank 0 writes a PNG of the aggregates (needs matplotlib)."""

    callbacks: list[str] = field(default_factory=list)
    """``pkg.module:factory`` names; each factory, called with no arguments, returns an object whose
    ``on_step(event)`` runs on every rank after each step, before its checkpoint (``event.step``: steps done;
    ``event.state["agents"].engine``: the engine; see :class:`multigpu.run.StepEvent`); in an ensemble after each
    wave (``event.step``: waves done; ``event.state["wave"]``: :class:`multigpu.sim.ensemble.Wave`). Importing
    the module runs its code."""

    network: NetworkConfig = field(default_factory=NetworkConfig)
    """The contact network of models that interact along edges (``network_sir``): ``network.kind`` = file,
    households, random or geometric (see :mod:`multigpu.sim.network`)."""

    differentiable: bool = False
    """Relax the stochastic decisions (straight-through Bernoulli) so gradients flow through the steps
    (strategy data; any model without a network field); see :mod:`multigpu.sim.calibration`. False: the exact
    model, unchanged."""

    calibrate: CalibrateConfig = field(default_factory=CalibrateConfig)
    """Learn parameters by gradient descent: ``calibrate.target`` (a CSV series) turns a run into a calibration
    (implies ``differentiable``); ``calibrate.learn`` (any float parameter), ``columns``, ``loss``, ``weights``,
    ``iterations``, ``lr``, ``truncate``."""

    population: str = ""
    """Read the agents from this file instead of the model's generator: ``.npz``, ``.csv``, ``.parquet`` or a
    folder of ``<field>.npy``; row i is agent i, fields without a column come from the model's ``init``.
    The number of agents is the file's (``agents`` is ignored). See :mod:`multigpu.sim.population`."""

    save_agents: str = ""
    """Write the final agents, ordered by id, to this file: ``.npz``, ``.parquet`` (needs pyarrow) or a folder
    of ``<field>.npy`` (any other name). A relative path is inside the run directory. Empty: not written."""

    ensemble: EnsembleConfig = field(default_factory=EnsembleConfig)
    """Many runs instead of one: ``ensemble.replicates`` (``--replicates N``), ``ensemble.sweep`` (``--sweep
    beta=0.1,0.2``, a grid), ``ensemble.sweep_file``, ``ensemble.until_ci`` (``--until-ci 95:0.01``); writes the
    mean and band of every series per point (see :mod:`multigpu.sim.ensemble`)."""

    check_split: bool = False
    """Instead of the run, check the model: run it on 1 and 2 ranks, every strategy, on a small population,
    and compare every agent (``multigpu sim --check-split``; see :mod:`multigpu.sim.splitcheck`)."""

    def __post_init__(self) -> None:
        from multigpu.config import from_dict
        from multigpu.sim.api import get_model, model_params

        for key, cls in (("network", NetworkConfig), ("calibrate", CalibrateConfig), ("ensemble", EnsembleConfig)):
            if isinstance(getattr(self, key), dict):  # SimConfig(network={"kind": ...}) in Python
                object.__setattr__(self, key, from_dict(cls, getattr(self, key), prefix=f"sim.{key}"))
        if self.calibrate.target:
            object.__setattr__(self, "differentiable", True)
        strategy = _STRATEGY_ALIASES.get(self.strategy, self.strategy)
        object.__setattr__(self, "strategy", strategy)
        if strategy not in STRATEGIES:
            raise ConfigError(f"sim.strategy {self.strategy!r} is not valid; valid: {', '.join(STRATEGIES)}")
        model = get_model(self.model)
        for name, low in [("agents", 1), ("steps", 0), ("sync_frequency", 1), ("rebalance_every", 1),
                          ("checkpoint_every", 0), ("keep_last", 1), ("sort_every", 0), ("chunk_size", 1024), ("log_every", 0)]:
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"sim.{name}={value!r} is invalid; valid: a whole number >= {low}")
        if self.agents > MAX_AGENTS:
            raise ConfigError(f"sim.agents={self.agents:_} is more than the {MAX_AGENTS:_} agent ids (int32) "
                              f"allow; valid: sim.agents <= {MAX_AGENTS:_}")
        if len(self.grid) != 2 or min(self.grid) < 1 or max(self.grid) > 32767:
            raise ConfigError(f"sim.grid={list(self.grid)} is invalid; valid: [height, width], each in 1..32767")
        if self.seed < 0 or self.seed >= 2**62:
            raise ConfigError(f"sim.seed={self.seed} is invalid; valid: 0 <= seed < 2**62")
        for name in ("overlap", "native"):  # YAML reads on/off as true/false
            if isinstance(getattr(self, name), bool):
                object.__setattr__(self, name, "on" if getattr(self, name) else "off")
        if self.overlap not in ("auto", "on", "off"):
            raise ConfigError(f"sim.overlap {self.overlap!r} is not valid; valid: auto, on, off")
        if self.native not in ("auto", "on", "off"):
            raise ConfigError(f"sim.native {self.native!r} is not valid; valid: auto, on, off")
        if self.backend not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"sim.backend {self.backend!r} is not valid; valid: auto, cuda, cpu")
        for name in self.substeps:
            model.substep(name)  # unknown, or needs fields the model lacks: ConfigError
        steps = [model.substep(n) for n in self.substeps] if self.substeps else list(model.substeps)
        if any(s.field == "network" for s in steps):
            if self.network.kind == "none":
                raise ConfigError(f"sim.model {self.model!r} interacts along a contact network; set sim.network.kind "
                                  "to households, random, geometric or file (with sim.network.path)")
            if strategy != "data":
                raise ConfigError(f"sim.strategy {strategy!r}: a contact network splits agents by id; use strategy data")
        if self.differentiable:
            nets = [s.name for s in steps if s.field == "network"]
            if strategy != "data" or (self.model == "sir" and self.params.get("seir")) or nets:
                raise ConfigError("sim.differentiable (and calibrate) supports strategy data, models without a "
                                  "network field, sir without seir; got "
                                  f"model {self.model!r}, strategy {strategy!r}" + (f", substep {nets[0]!r}" if nets else ""))
            if self.calibrate.target:
                check_learning(self, model)
        if strategy != "data" and not model.spatial:
            raise ConfigError(f"sim.strategy {strategy!r} splits the grid, but model {self.model!r} has no "
                              "positions; use strategy data")
        object.__setattr__(self, "params", dataclasses.asdict(model_params(model, self.params)))
        if self.ensemble.active:
            self._check_ensemble()

    def _check_ensemble(self) -> None:
        """What an ensemble cannot do: one line naming the setting and what to do instead."""
        clash = [(self.check_split, "--check-split", "run the check on its own"),
                 (self.calibrate.target, "--calibrate", "fit to the mean of K replicates with calibrate.replicates=K"),
                 (self.differentiable, "sim.differentiable", "run the relaxed model on its own"),
                 (self.save_agents, "--save-agents", "save the agents of one run (seed=...) on its own"),
                 (self.checkpoint_every, "--checkpoint-every", "leave it out: an ensemble keeps every finished "
                                                               "replicate, and --resume auto runs the others")]
        for value, name, instead in clash:
            if value:
                raise ConfigError(f"{name} does not combine with an ensemble (--replicates, --sweep); valid: {instead}")

    @property
    def substep_names(self) -> tuple[str, ...]:
        """The substeps that run, in order (the config's list or the model's default)."""
        from multigpu.sim.api import get_model

        return self.substeps or get_model(self.model).substep_names

    @property
    def bytes_per_agent(self) -> int:
        """Bytes of one agent's state (its fields, the id included)."""
        from multigpu.sim.api import get_model

        return sum(dtype.itemsize for dtype in get_model(self.model).fields.values())

    def bytes_per_rank(self, agents: int, world_size: int) -> int:
        """About the peak memory of one rank's agents and grid cells (a rank's own process not included)."""
        from multigpu.sim.api import get_model

        per_rank = -(-agents // world_size)
        rows = self.grid[0] if self.strategy == "data" else -(-self.grid[0] // world_size) + 2
        cells = rows * self.grid[1] if get_model(self.model).spatial else 0
        return per_rank * self.bytes_per_agent * WORKING_BYTES_FACTOR + cells * CELL_BYTES

    def check_world(self, world_size: int) -> None:
        """Checks that need the rank count: a spatial split needs at least one grid row per rank."""
        if self.strategy != "data" and self.grid[0] < world_size:
            raise ConfigError(f"sim.grid has {self.grid[0]} rows, fewer than the {world_size} ranks of the "
                              f"{self.strategy} strategy (each rank owns at least one row); "
                              "use a taller grid, fewer ranks, or strategy data")
