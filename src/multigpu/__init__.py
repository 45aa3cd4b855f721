"""multigpu: run a PyTorch workload on every GPU of one machine or many, and measure what it gained.

The public runtime API (runs inside each rank)::

    import multigpu as mg

    env = mg.init()                  # reads torchrun / SLURM variables, or runs as world_size 1
    mine = mg.shard(items)           # this rank's slice; every item exactly once
    out = mg.gather(results)         # in the original order, on rank 0
    mg.shutdown()

The workloads and tools are attributes too, imported on first use so that a rank
which wants only the runtime never loads them: ``mg.train``, ``mg.sim``,
``mg.infer``, ``mg.rl``, ``mg.envs``, ``mg.verify``, ``mg.bench``, ``mg.monitor``, and ``mg.run`` (the run
harness every workload runs on)::

    out = mg.infer.sliding_window(image, model, roi=256, overlap=0.25)

Launch with ``multigpu launch --gpus all script.py`` (see ``multigpu --help``).
"""

from typing import TYPE_CHECKING

from multigpu import _startup  # noqa: F401 - first: a Ctrl-C while the command line imports torch is one line
from multigpu.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    ConfigError,
    DeviceError,
    MultigpuError,
    NotInitializedError,
    OutputError,
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

_LAZY_SUBPACKAGES = ("bench", "envs", "infer", "monitor", "rl", "run", "sim", "train", "verify")
"""Subpackages reachable as ``mg.<name>`` after ``import multigpu``, imported on first use."""

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports them
    from multigpu import bench as bench
    from multigpu import envs as envs
    from multigpu import infer as infer
    from multigpu import monitor as monitor
    from multigpu import rl as rl
    from multigpu import run as run
    from multigpu import sim as sim
    from multigpu import train as train
    from multigpu import verify as verify


def __getattr__(name: str):
    # `mg.infer.sliding_window(...)` works after a plain `import multigpu as mg`; importing the
    # workloads eagerly would load all of them into every process that only wants the runtime
    if name in _LAZY_SUBPACKAGES:
        import importlib

        return importlib.import_module(f"multigpu.{name}")  # also binds it here: later lookups skip this
    raise AttributeError(f"module 'multigpu' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBPACKAGES})


__all__ = [
    "CollectiveError",
    "CollectiveTimeoutError",
    "ConfigError",
    "DeviceError",
    "DistEnv",
    "MultigpuError",
    "RunContext",
    "NotInitializedError",
    "OutputError",
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
