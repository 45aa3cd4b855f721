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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from multigpu import envvars
from multigpu.errors import ConfigError
from multigpu.runtime.clusters import read_int, read_port, slurm_master_port  # noqa: F401 - re-exported

__all__ = ["LAUNCHER_VARIABLES", "RESTART_VAR", "Placement", "cpu_count", "expand_slurm_nodelist",
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


def _int(env: Mapping[str, str], name: str) -> int:
    return read_int(env, name)


def first_slurm_host(env: Mapping[str, str]) -> str | None:
    """The first host of ``SLURM_JOB_NODELIST`` (else ``SLURM_NODELIST``), without expanding the list."""
    from multigpu.runtime.clusters import SLURM

    return SLURM(env).first_host()


MAX_LISTED_HOSTS = 1_000_000
"""The most host names :func:`expand_slurm_nodelist` lists (a billion would be gigabytes of strings)."""


def expand_slurm_nodelist(nodelist: str, variable: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Every host of a SLURM node list such as ``gpu[01-03,7],login1`` (see :mod:`multigpu.runtime.hostlist`).

    Raises:
        ConfigError: a malformed list, or one of more than :data:`MAX_LISTED_HOSTS` names (counted, not expanded:
            ``multigpu.runtime.hostlist``'s ``first_host``, ``count_hosts`` and ``iter_hosts`` read any size).
    """
    from multigpu.runtime.hostlist import count_hosts, iter_hosts, parse_hostlist

    parsed = parse_hostlist(nodelist, variable)
    count = count_hosts(parsed)
    if count > MAX_LISTED_HOSTS:
        raise ConfigError(f"{variable}={nodelist!r} holds {count:,} hosts, more than a list of names holds (at most "
                          f"{MAX_LISTED_HOSTS:,}); valid: a real allocation's node list, or "
                          "multigpu.runtime.hostlist.iter_hosts to walk it, first_host and count_hosts to read it")
    return list(iter_hosts(parsed, variable))


def read_placement(env: Mapping[str, str] | None = None) -> Placement:
    """Read rank coordinates from torchrun's variables, else SLURM's, else world_size 1 (the cluster environment
    that started this rank: :func:`multigpu.runtime.clusters.rank_environment`)."""
    from multigpu.runtime.clusters import SLURM, Local, rank_environment

    cluster = rank_environment(os.environ if env is None else env)
    if isinstance(cluster, Local):
        return Placement()
    placement = Placement(
        rank=cluster.global_rank(), local_rank=cluster.local_rank(), world_size=cluster.world_size(),
        local_world_size=cluster.local_world_size(), node_rank=cluster.group_rank(),
        master_addr=cluster.rank_main_address(), master_port=cluster.rank_main_port(),
        source="slurm" if isinstance(cluster, SLURM) else "torchrun",
    )
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
