"""Where this process stands in the job: rank, world size, node (runs inside each rank).

Read from the variables torchrun's agent sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``), else from SLURM's
(``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, ...), else the process
runs alone as ``world_size == 1``. Pure functions of the environment mapping,
so tests pass dictionaries.

Rank variables can also be leftovers: ``WORLD_SIZE=2 RANK=0`` exported in a
shell, ``SLURM_PROCID`` inside an ``sbatch`` script run without ``srun``.
:func:`launcher_variable` names the variable that shows a launcher is really
there (torchrun's agent, ``multigpu launch``, ``srun``);
without one, ``mg.init`` says what it found and waits only briefly.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from multigpu import envvars
from multigpu.errors import ConfigError

__all__ = ["LAUNCHER_VARIABLES", "RESTART_VAR", "DistEnv", "Placement", "cpu_count", "expand_slurm_nodelist",
           "first_slurm_host", "found_variables", "launcher_variable", "read_int", "read_placement", "read_port",
           "restart_count", "slurm_master_port"]

LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", envvars.RUN_FILE, "SLURM_STEP_ID", "SLURM_STEPID")
"""Set by a launcher beside the rank variables: torchrun's agent, ``multigpu launch`` and ``srun`` (a job
step). A caller that brings its own rendezvous (``mg.init(init_method=...)``, as the test harness does) needs
none of them."""

_RANK_VARIABLES = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "MASTER_ADDR", "MASTER_PORT"),
}

Source = Literal["torchrun", "slurm", "single"]


@dataclass(frozen=True, slots=True)
class Placement:
    """The rank coordinates read from the environment, before any process group exists."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    source: Source = "single"


@dataclass(frozen=True)
class DistEnv:
    """This rank's place in the job, returned by :func:`multigpu.init`.

    Also a context manager: ``with mg.init() as env: ...`` calls
    :func:`multigpu.shutdown` on exit (without the final barrier when leaving
    on an exception, so a failing rank does not wait for the others).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: torch.device
    backend: str
    """Process-group backend: ``"nccl"``, ``"gloo"``, or ``"none"`` when ``world_size == 1``."""

    def is_main(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

    def __enter__(self) -> DistEnv:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from multigpu.runtime.group import shutdown

        shutdown(barrier=exc_type is None)


_SLURM_COUNT = re.compile(r"([0-9]+)(?:\(x[0-9]+\))?(?:,.*)?")
"""SLURM's per-node counts: ``4``, ``4(x2)`` (4 on each of 2 nodes), ``4(x2),2`` (then 2 on the next)."""


def read_int(env: Mapping[str, str], name: str, *, minimum: int = 0, maximum: int | None = None,
             slurm_count: bool = False) -> int:
    """``env[name]`` as a whole number of ASCII digits, else one line naming the variable (the one parser of
    every scheduler's and launcher's variable, in the launcher and in the ranks).

    ``slurm_count``: SLURM's ``N(xM)`` form is read as ``N`` (the first node's count).
    Raises:
        ConfigError: not such a number (``int()`` alone takes ``'²'``-like digits no launcher writes, ``' 4'``
            and ``'4_0'``), or outside ``[minimum, maximum]``.
    """
    raw = env[name]
    match = (_SLURM_COUNT if slurm_count else _DIGITS).fullmatch(raw)
    if match is None:
        form = "a whole number such as 4 (SLURM also writes 4(x2))" if slurm_count else "a whole number such as 4"
        raise ConfigError(f"environment variable {name}={raw!r} must be a whole number; valid: {form}")
    value = int(match.group(1))
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" to {maximum}" if maximum is not None else " or more"
        raise ConfigError(f"environment variable {name}={raw} is out of range; valid: {minimum}{upper}")
    return value


_DIGITS = re.compile(r"([0-9]+)")


def _int(env: Mapping[str, str], name: str) -> int:
    return read_int(env, name)


def read_port(env: Mapping[str, str], name: str) -> int:
    """A port variable (``MASTER_PORT``...): 0 to 65535, one line naming it otherwise."""
    return read_int(env, name, maximum=65535)


def first_slurm_host(env: Mapping[str, str]) -> str | None:
    """The first host of ``SLURM_JOB_NODELIST`` (else ``SLURM_NODELIST``), without expanding the list."""
    from multigpu.runtime.hostlist import first_host

    name = "SLURM_JOB_NODELIST" if env.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    return first_host(env.get(name, ""), name)


def expand_slurm_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Every host of a SLURM node list such as ``gpu[01-03,7],login1`` (see :mod:`multigpu.runtime.hostlist`)."""
    from multigpu.runtime.hostlist import iter_hosts

    return list(iter_hosts(nodelist, variable))


def slurm_master_port(job_id: str | None) -> int:
    """A port derived from the SLURM job id, so every task of a job agrees without talking.

    SLURM gives no rendezvous port; ``MASTER_PORT`` wins when set.
    """
    if job_id and _DIGITS.fullmatch(job_id):
        return 15000 + int(job_id[-4:]) % 20000
    return 29500


def _slurm_local_world_size(env: Mapping[str, str], ntasks: int) -> int:
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            return read_int(env, name, minimum=1, slurm_count=True)  # "4(x2)": 4 tasks on each of 2 nodes
    return ntasks


def read_placement(env: Mapping[str, str] | None = None) -> Placement:
    """Read rank coordinates from torchrun's variables, else SLURM's, else world_size 1."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = _int(env, "WORLD_SIZE")
        rank = _int(env, "RANK")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world_size
        node_rank = _int(env, "GROUP_RANK") if "GROUP_RANK" in env else rank // max(local_world, 1)
        placement = Placement(
            rank, local_rank, world_size, local_world, node_rank,
            env.get("MASTER_ADDR"), read_port(env, "MASTER_PORT") if env.get("MASTER_PORT") else None, "torchrun",
        )
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world_size = _int(env, "SLURM_NTASKS")
        placement = Placement(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=world_size,
            local_world_size=_slurm_local_world_size(env, world_size),
            node_rank=_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0,
            master_addr=env.get("MASTER_ADDR") or first_slurm_host(env) or "127.0.0.1",
            master_port=read_port(env, "MASTER_PORT") if env.get("MASTER_PORT") else
            slurm_master_port(env.get("SLURM_JOB_ID")),
            source="slurm",
        )
    else:
        return Placement()
    if not 0 <= placement.rank < placement.world_size:
        raise ConfigError(f"rank {placement.rank} is outside [0, {placement.world_size}) (world_size)")
    if not 0 <= placement.local_rank < placement.local_world_size:
        raise ConfigError(
            f"local_rank {placement.local_rank} is outside [0, {placement.local_world_size}) (local_world_size)"
        )
    return placement


def launcher_variable(env: Mapping[str, str] | None = None) -> str | None:
    """The first of :data:`LAUNCHER_VARIABLES` that is set (a launcher started this process), else None."""
    env = os.environ if env is None else env
    return next((name for name in LAUNCHER_VARIABLES if env.get(name)), None)


def found_variables(source: Source, env: Mapping[str, str] | None = None) -> str:
    """``RANK=0 WORLD_SIZE=2 MASTER_ADDR=host``: the rank variables of ``source`` that are set, for messages."""
    env = os.environ if env is None else env
    return " ".join(f"{name}={env[name]}" for name in _RANK_VARIABLES.get(source, ()) if name in env)


def cpu_count() -> int:
    """Cores this process may run on (its CPU affinity, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"


def restart_count() -> int:
    """How many times torchrun's agent has restarted this worker group (``--max-restarts``); 0 at first.

    The only place that reads ``TORCHELASTIC_RESTART_COUNT`` (set by the agent in every worker).
    """
    try:
        return int(os.environ.get(RESTART_VAR, "0"))
    except ValueError:
        return 0
