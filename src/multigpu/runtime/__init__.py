"""The runtime: code that runs inside each rank. Depends only on torch and ``multigpu.errors``.

Glossary: *shard* = this rank's slice of the data; *rank* = global process
index; *local_rank* = index on this node; *world_size* = processes in the job;
*run* = one execution of a workload (its folder, its ``run.json``): its context
is a :class:`~multigpu.runtime.context.RunContext`, named ``ctx`` wherever it is
held, and :class:`multigpu.run.Run` carries it over time. The runtime is not
the run: it is the API every rank calls, whatever runs.
"""

from multigpu.runtime.collectives import (
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    broadcast_object,
    collective_seconds,
    gather,
)
from multigpu.runtime.group import (
    DistEnv,
    backend,
    device,
    get_env,
    init,
    is_initialized,
    is_main,
    local_rank,
    rank,
    shutdown,
    world_size,
)
from multigpu.runtime.logging import get_logger, rank_zero_only, warn_once
from multigpu.runtime.samplers import ShardSampler, TrainSampler
from multigpu.runtime.sharding import shard, shard_bounds, shard_range, shard_sizes

__all__ = [
    "DistEnv",
    "ShardSampler",
    "TrainSampler",
    "all_gather",
    "all_reduce",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_object",
    "collective_seconds",
    "device",
    "gather",
    "get_env",
    "get_logger",
    "init",
    "is_initialized",
    "is_main",
    "local_rank",
    "rank",
    "rank_zero_only",
    "shard",
    "shard_bounds",
    "shard_range",
    "shard_sizes",
    "shutdown",
    "warn_once",
    "world_size",
]
