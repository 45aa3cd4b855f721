"""What a launched script does that cannot make one job, told inside each rank (the worker wrapper, ``_worker.py``,
installs these checks once torch is imported; nothing else imports this module).

Two shapes of code written before torchrun meet a launcher that has already started one process per rank:

1. **it spawns its own workers**: ``torch.multiprocessing.spawn`` (pytorch/examples' imagenet ``main.py
   --multiprocessing-distributed``, most code from before torchrun). Each spawned worker inherits the launcher's
   environment, where ``TORCHELASTIC_USE_AGENT_STORE`` makes its ``tcp://`` init wait, as a client, for a store
   nobody serves: the job stood still for the collective timeout (30 minutes), silently. Here a spawned worker
   refuses to join a process group, with :data:`SPAWNED_LINE`, and the rank that spawned it raises that line, so
   the launcher's summary shows what to change. A spawned worker that joins no group (a pool of helpers) runs as
   before.
2. **it trains alone on every rank**: it ignores ``RANK``/``WORLD_SIZE`` and never joins the job (imagenet's
   ``main.py`` without ``--dist-url env://``), or joins a group of one. The launcher said so when the job ended;
   with ``WORLD_SIZE`` above 1, rank 0 now says so at its first optimizer step (one line on stderr, a warning: a
   script may mean to run independent copies). A group of one is told when it is made.

Both are facts the rank sees, never guesses: no line appears for a script that joins the job.
"""

from __future__ import annotations

import functools
import os
import sys

__all__ = ["SPAWNED_LINE", "install"]

SPAWNED_LINE = (
    "the script starts its own workers (torch.multiprocessing.spawn) and they join a process group: under multigpu "
    "launch each rank is already one of the job's workers, and those it spawns wait for a group that never forms. "
    "Call the worker function once in each rank instead, with the launcher's RANK, LOCAL_RANK and WORLD_SIZE "
    "(pytorch/examples' imagenet main.py: leave out --multiprocessing-distributed and pass --dist-url env://)"
)
_MARK = "multigpu-spawned-worker: "


def install(world_size: int, rank: str) -> None:
    """Install both checks in this launched rank (``world_size``, ``rank``: the launcher's)."""
    _guard_spawn()
    if world_size > 1:
        _tell_copies(world_size, rank)


def _guard_spawn() -> None:
    """Make ``torch.multiprocessing.spawn``'s workers refuse to join a process group (see the module docstring)."""
    import importlib

    import torch.multiprocessing as tmp

    spawn_module = importlib.import_module("torch.multiprocessing.spawn")  # tmp.spawn is the function

    original = spawn_module.start_processes

    def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
        try:
            return original(functools.partial(_spawned_worker, fn), args, nprocs, join, daemon, start_method)
        except spawn_module.ProcessRaisedException as exc:
            if _MARK in str(exc):
                raise RuntimeError(SPAWNED_LINE) from None
            raise

    start_processes.__wrapped__ = original
    start_processes.__doc__ = original.__doc__
    for namespace in (spawn_module, tmp):  # spawn() looks it up in its module; torch.multiprocessing re-exports it
        if getattr(namespace, "start_processes", None) is original:
            namespace.start_processes = start_processes


def _spawned_worker(fn, index, *args):
    """Run in a worker that ``torch.multiprocessing.spawn`` started inside a launched rank: ``fn(index, *args)``,
    with every way into a process group closed."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    def refuse(*_args, **_kwargs):
        raise RuntimeError(_MARK + SPAWNED_LINE)

    # the public name (where the script finds it) and the rendezvous that init_process_group calls, for a name the
    # script bound before this ran (``from torch.distributed import init_process_group`` at its top)
    for namespace, name in ((dist, "init_process_group"), (distributed_c10d, "init_process_group"),
                            (distributed_c10d, "rendezvous")):
        setattr(namespace, name, refuse)
    return fn(index, *args)


def _tell_copies(world_size: int, rank: str) -> None:
    """Rank 0's first optimizer step with no process group says that every rank trains alone."""
    if rank != "0":
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    handle = None

    def first_step(optimizer, args, kwargs) -> None:
        handle.remove()  # one look, at the first step of any optimizer
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            _warn(f"rank 0 steps an optimizer with no process group in a job of {world_size} ranks: the "
                  f"{world_size} ranks each train their own copy on all the data, and nothing is averaged. "
                  + _JOIN)

    handle = register_optimizer_step_pre_hook(first_step)


_JOIN = ("Join the job before training: mg.init(), or torch.distributed.init_process_group() with the launcher's "
         "environment (pytorch/examples' imagenet main.py: --dist-url env://)")


def group_of_one(world_size: int, rank: str) -> None:
    """Called when this rank has made the default process group: one line when its size is 1 in a job of
    ``world_size`` > 1 ranks (the script passed ``world_size=1``; every rank then trains alone)."""
    import torch.distributed as dist

    if world_size > 1 and rank == "0" and dist.get_world_size() == 1:
        _warn(f"rank 0 made a process group of one rank in a job of {world_size} ranks (init_process_group with "
              f"world_size=1): the {world_size} ranks each train their own copy, and nothing is averaged. Join the "
              "job instead: mg.init(), or torch.distributed.init_process_group() without world_size= and rank= "
              "(pytorch/examples' imagenet main.py: --dist-url env://)")


def _warn(line: str) -> None:
    print(f"multigpu: warning: {line}", file=sys.stderr, flush=True)


def world_size_from_env() -> int:
    """The launcher's ``WORLD_SIZE`` (1 where it is missing or not a number)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1
