"""Distributed agent-based simulation (inside each rank); ``multigpu sim`` launches it.

    import multigpu as mg
    import multigpu.sim

    mg.init()
    cfg = mg.sim.SimConfig(model="sir", agents=1_000_000, steps=50, strategy="spatial")
    result = mg.sim.run(cfg)          # rank 0: a SimResult (series, final counts, figures); others: None
    mg.shutdown()

Your own model: :mod:`multigpu.sim.api` (``Model``, ``Substep``, ``Context``), then
``SimConfig(model="pkg.module:MODEL")`` or ``multigpu sim --model pkg.module:MODEL``.

Glossary: *agent* = one row of the struct-of-arrays state; *cell* = one grid
square; *field* = an integer value per cell (or a few global sums) summed
over all ranks; *partition* = one rank's rows of the grid; *halo* = rows
copied from the neighbouring ranks; *step* = one simulation update.
"""

from multigpu.sim.api import (
    MODELS,
    SUBSTEPS,
    Context,
    Model,
    NoParams,
    Substep,
    get_model,
    neighbourhood_sum,
    register_model,
    spawn_on_grid,
)
from multigpu.sim.calibration import calibrate
from multigpu.sim.config import STRATEGIES, SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.models import MODELS as _BUILTIN_MODELS  # noqa: F401 - registers the built-in models
from multigpu.sim.runner import SimResult, run

__all__ = ["MODELS", "STRATEGIES", "SUBSTEPS", "Context", "Model", "NoParams", "SimConfig", "SimEngine", "SimResult",
           "Substep", "calibrate", "get_model", "neighbourhood_sum", "register_model", "run", "spawn_on_grid"]
