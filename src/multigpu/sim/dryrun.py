"""The sim workload as rank r of N: its agents and grid rows, and their memory (launcher side, estimated).

The split is the engine's own math: agents by id with :func:`multigpu.runtime.sharding.shard_bounds`
(strategy data), grid rows with :func:`multigpu.sim.partition.even_borders` (spatial, and adaptive before
its first rebalance). Memory is :meth:`multigpu.sim.config.SimConfig.bytes_per_rank`'s estimate (the state
of each agent times the measured working-copy factor, plus the cells the rank holds): the agents are not
built, so nothing here is measured.
"""

from __future__ import annotations

from multigpu.jobs.dryrun import Figure, Report

__all__ = ["examine"]


def examine(cfg, plan, rank: int, report: Report) -> None:
    from multigpu.runtime.sharding import shard_bounds
    from multigpu.sim.config import WORKING_BYTES_FACTOR
    from multigpu.sim.partition import even_borders

    world = plan.world_size
    agents = cfg.agents * plan.run.problem_scale(world)
    start, stop = shard_bounds(agents, rank, world)
    report.lines.append(f"model {cfg.model}, strategy {cfg.strategy}; {agents:,} agents")
    if cfg.strategy == "data":
        report.lines.append(f"rank {rank} holds agents [{start:,}, {stop:,}): {stop - start:,} of them")
    elif cfg.grid[0] >= world:
        borders = even_borders(cfg.grid[0], world)
        report.lines.append(f"rank {rank} owns grid rows [{borders[rank]}, {borders[rank + 1]}) of {cfg.grid[0]} "
                            f"(about {stop - start:,} agents where they are spread evenly)")
    idle = world - min(agents, world)
    if idle:
        report.warnings.append(f"{agents:,} agents on {world} ranks: {idle} rank(s) hold no agent (they step "
                               "empty); fewer ranks do the same work")
    state = (stop - start) * cfg.bytes_per_agent
    total = cfg.bytes_per_rank(agents, world)
    cells = cfg.bytes_per_rank(0, world)
    report.memory += [
        Figure("agent state", state, "estimated", f"{cfg.bytes_per_agent} bytes per agent"),
        Figure("working copies", total - cells - state, "estimated",
               f"with the state {WORKING_BYTES_FACTOR}× it: growth, sorting, migration (measured on CPU)"),
        Figure("grid cells", cells, "estimated"),
    ]
    report.peak = Figure("peak of a step", total, "estimated")
    report.memory.append(report.peak)
