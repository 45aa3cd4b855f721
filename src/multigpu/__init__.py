"""multigpu: run a PyTorch workload on every GPU of one machine or many, and measure what it gained.

The public runtime API (runs inside each rank)::

    import multigpu as mg

    env = mg.init()                  # reads torchrun / SLURM variables, or runs as world_size 1
    mine = mg.shard(items)           # this rank's slice; every item exactly once
    out = mg.gather(results)         # in the original order, on rank 0
    mg.shutdown()

Launch with ``multigpu launch --gpus all script.py`` (see ``multigpu --help``).
"""

from multigpu import verify
from multigpu.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    DeviceError,
    MultigpuError,
    NotInitializedError,
    ShapeMismatchError,
)
from multigpu.runtime import (
    DistEnv,
    ShardSampler,
    TrainSampler,
    all_gather,
    all_reduce,
    backend,
    barrier,
    broadcast,
    broadcast_object,
    device,
    gather,
    get_env,
    get_logger,
    init,
    is_initialized,
    is_main,
    local_rank,
    rank,
    rank_zero_only,
    shard,
    shard_range,
    shutdown,
    world_size,
)
from multigpu.runtime.context import RunContext
from multigpu.runtime.context import current as run_context

__version__ = "0.1.0"

_LAZY_SUBPACKAGES = ("envs",)
"""Workload subpackages reachable as ``mg.<name>`` without importing them with ``multigpu``."""


def __getattr__(name: str):
    # `mg.envs.make(...)` works after a plain `import multigpu as mg`; importing it eagerly
    # would load every workload into every process that only wants the runtime
    if name in _LAZY_SUBPACKAGES:
        import importlib

        return importlib.import_module(f"multigpu.{name}")
    raise AttributeError(f"module 'multigpu' has no attribute {name!r}")


__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DeviceError",
    "DistEnv",
    "MultigpuError",
    "RunContext",
    "NotInitializedError",
    "ShapeMismatchError",
    "ShardSampler",
    "TrainSampler",
    "__version__",
    "all_gather",
    "all_reduce",
    "backend",
    "barrier",
    "broadcast",
    "broadcast_object",
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
    "run_context",
    "shard",
    "shard_range",
    "shutdown",
    "verify",
    "world_size",
]
