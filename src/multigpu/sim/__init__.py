"""Distributed agent-based simulation (inside each rank); ``multigpu sim`` launches it.

    import multigpu as mg
    import multigpu.sim

    mg.init()
    cfg = mg.sim.SimConfig(model="sir", agents=1_000_000, steps=50, strategy="spatial")
    result = mg.sim.run(cfg)          # rank 0: a SimResult (series, final counts, figures); others: None
    mg.shutdown()

Glossary: *agent* = one row of the struct-of-arrays state; *cell* = one grid
square; *field* = an integer value per cell (or a few global sums) summed
over all ranks; *partition* = one rank's rows of the grid; *halo* = rows
copied from the neighbouring ranks; *step* = one simulation update.
"""

from multigpu.sim.config import STRATEGIES, SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.sim.models import MODELS, SUBSTEPS
from multigpu.sim.runner import SimResult, run

__all__ = ["MODELS", "STRATEGIES", "SUBSTEPS", "SimConfig", "SimEngine", "SimResult", "run"]
