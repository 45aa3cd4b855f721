"""One class per cluster environment, read alike by the launcher and by the ranks (pure: a mapping in).

Lightning Fabric's ``ClusterEnvironment`` shape (``lightning.fabric.plugins.environments``): each class says
whether it started this process (``detect``) and answers in its scheduler's own variables. Two kinds of
process ask:

* the launcher, once per node (:func:`node_environment`; ``multigpu.launch.schedulers``): how many nodes, this
  node's index (``node_rank()``: what the scheduler says, torchrun's ``--node-rank``), where the rendezvous is, how
  many workers this node runs: torchrun's launcher flags;
* a rank (:func:`rank_environment`; ``multigpu.runtime.env``): its rank, local rank, world size, its worker
  group's rank (``group_rank()``: its node's place in the job as the rendezvous formed it, torchrun's
  ``GROUP_RANK``; c10d hands it out in join order, so it need not be the launcher's ``node_rank()``), and the
  address of the job's store: torchrun's worker variables.

| class | detected by (launcher) | detected by (rank) | nnodes | node rank | endpoint | workers per node |
|---|---|---|---|---|---|---|
| :class:`Kubeflow` (PyTorchJob, torchrun's ``PET_*``) | ``PET_NNODES`` | — | ``PET_NNODES`` | ``PET_NODE_RANK`` | ``PET_RDZV_ENDPOINT``, else ``PET_MASTER_ADDR:PET_MASTER_PORT`` | ``PET_NPROC_PER_NODE`` |
| :class:`SLURM` (``srun``, one task per node) | ``SLURM_STEP_ID`` | ``SLURM_PROCID`` + ``SLURM_NTASKS`` | ``SLURM_NNODES`` | ``SLURM_NODEID`` | first host of ``SLURM_JOB_NODELIST``, ``MASTER_PORT`` or a port from ``SLURM_JOB_ID`` | ``SLURM_GPUS_ON_NODE`` / ``SLURM_GPUS_PER_NODE`` |
| :class:`LSF` (``jsrun``/``blaunch``) | ``LSB_JOBID`` + ``LSB_DJOB_RANKFILE`` | — | hosts in the rank file | this host's place in it | first host, ``MASTER_PORT`` or a port from ``LSB_JOBID`` | — |
| :class:`OpenMPI` (``mpirun -N 1``) | ``OMPI_COMM_WORLD_SIZE`` | — | ``OMPI_COMM_WORLD_SIZE`` | ``OMPI_COMM_WORLD_RANK`` | ``MASTER_ADDR:MASTER_PORT`` (required) | — |
| :class:`TorchElastic` (torchrun's agent, ``multigpu launch``) | — | ``RANK`` + ``WORLD_SIZE`` | | | | |
| :class:`Local` (nothing) | — | always | 1 | 0 | | |

Numbers are read by one parser (:func:`read_int`: ASCII digits only, SLURM's ``4(x2)`` where SLURM writes it),
and every bad value is one :class:`~multigpu.errors.ConfigError` line naming its variable.
"""

from __future__ import annotations

import os
import re
import socket
import stat
from collections.abc import Mapping
from typing import ClassVar

from multigpu.errors import ConfigError

__all__ = ["LSF", "SLURM", "ClusterEnvironment", "Kubeflow", "Local", "OpenMPI", "TorchElastic", "node_environment",
           "rank_environment", "read_int", "read_port", "slurm_master_port"]

_DIGITS = re.compile(r"([0-9]+)")
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


def read_port(env: Mapping[str, str], name: str) -> int:
    """A port variable (``MASTER_PORT``...): 0 to 65535, one line naming it otherwise."""
    return read_int(env, name, maximum=65535)


def slurm_master_port(job_id: str | None) -> int:
    """A port derived from a scheduler's job id, so every task of a job agrees without talking (29500 without
    one). SLURM and LSF give no rendezvous port; ``MASTER_PORT`` wins when set."""
    if job_id and _DIGITS.fullmatch(job_id):
        return 15000 + int(job_id[-4:]) % 20000
    return 29500


def host_port(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ClusterEnvironment:
    """What one cluster environment says about this process. Subclasses answer the questions their scheduler
    answers; a question it does not answer gives None (the launcher's and the ranks' defaults then apply)."""

    name: ClassVar[str] = "local"
    """How messages name the environment (``--nnodes 4 contradicts SLURM, which says 2``)."""

    def __init__(self, env: Mapping[str, str], hostname: str | None = None):
        self.env = env
        self.hostname = hostname

    # ------------------------------------------------------------------ detection
    @classmethod
    def detect_node(cls, env: Mapping[str, str]) -> bool:
        """This environment started the launcher of this node."""
        return False

    @classmethod
    def detect_rank(cls, env: Mapping[str, str]) -> bool:
        """This environment started this rank (its rank variables are set)."""
        return False

    # ------------------------------------------------------------------ the launcher's questions
    def nnodes(self) -> int:
        return 1

    def min_nodes(self) -> int | None:
        """The fewest nodes an elastic job goes on with, where the scheduler says it (None: a fixed size)."""
        return None

    def node_rank(self) -> int:
        """This node's index among ``nnodes``, as the scheduler placed it."""
        return 0

    def main_address(self) -> str | None:
        """The host of the rendezvous (the job's first node)."""
        return None

    def main_port(self) -> int | None:
        return None

    def rdzv_endpoint(self) -> str | None:
        """``main_address:main_port``, or None when no address is known."""
        host = self.main_address()
        return host_port(host, self.main_port() or 29500) if host else None

    def nproc_per_node(self) -> int | None:
        """Workers this node runs, where the environment says (None: the launcher decides)."""
        return None

    # ------------------------------------------------------------------ the ranks' questions
    def global_rank(self) -> int:
        return 0

    def world_size(self) -> int:
        return 1

    def local_rank(self) -> int:
        return 0

    def local_world_size(self) -> int:
        return self.world_size()

    def group_rank(self) -> int:
        """This rank's worker group (its node) in the job as it formed: torchrun's ``GROUP_RANK``, else
        ``rank // local_world_size``. A rank's ``DistEnv.node_rank``."""
        return self.global_rank() // max(self.local_world_size(), 1)

    def rank_main_address(self) -> str | None:
        """Where this rank's job keeps its store (``MASTER_ADDR``)."""
        return None

    def rank_main_port(self) -> int | None:
        return None

    def _int(self, name: str, **kwargs) -> int:
        return read_int(self.env, name, **kwargs)

    def _given(self, name: str) -> bool:
        return bool(self.env.get(name))


class Local(ClusterEnvironment):
    """No launcher and no scheduler: one process, ``world_size == 1``."""

    name = "local"

    @classmethod
    def detect_rank(cls, env: Mapping[str, str]) -> bool:
        return True


class TorchElastic(ClusterEnvironment):
    """torchrun's agent (and so ``multigpu launch``) started this rank: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``."""

    name = "torchrun"

    @classmethod
    def detect_rank(cls, env: Mapping[str, str]) -> bool:
        return "RANK" in env and "WORLD_SIZE" in env

    def global_rank(self) -> int:
        return self._int("RANK")

    def world_size(self) -> int:
        return self._int("WORLD_SIZE")

    def local_rank(self) -> int:
        return self._int("LOCAL_RANK") if "LOCAL_RANK" in self.env else 0

    def local_world_size(self) -> int:
        return self._int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in self.env else self.world_size()

    def group_rank(self) -> int:
        return self._int("GROUP_RANK") if "GROUP_RANK" in self.env else super().group_rank()

    def rank_main_address(self) -> str | None:
        return self.env.get("MASTER_ADDR")

    def rank_main_port(self) -> int | None:
        return read_port(self.env, "MASTER_PORT") if self._given("MASTER_PORT") else None


class Kubeflow(ClusterEnvironment):
    """A Kubeflow PyTorchJob's pod (or torchrun's flags as ``PET_*`` variables): one launcher per pod."""

    name = "PET_* (Kubeflow PyTorchJob / torchrun)"

    @classmethod
    def detect_node(cls, env: Mapping[str, str]) -> bool:
        return "PET_NNODES" in env

    def nnodes(self) -> int:
        return self._nodes()[1]

    def min_nodes(self) -> int | None:
        """An elastic PyTorchJob's (``elasticPolicy``) ``PET_NNODES=MIN:MAX``: MIN; None for one number."""
        return self._nodes()[0]

    def _nodes(self) -> tuple[int | None, int]:
        raw = self.env.get("PET_NNODES", "")
        low, sep, high = raw.partition(":")
        if not sep:
            return None, self._int("PET_NNODES", minimum=1)
        try:
            least, most = (read_int({"PET_NNODES": part}, "PET_NNODES", minimum=1) for part in (low, high))
        except ConfigError:
            least = most = 0
        if not 1 <= least <= most:
            raise ConfigError(f"environment variable PET_NNODES={raw!r} must be a number of nodes or MIN:MAX; "
                              "valid: a whole number such as 4, or MIN:MAX with 1 <= MIN <= MAX such as 1:4")
        return least, most

    def node_rank(self) -> int:
        return self._int("PET_NODE_RANK") if self._given("PET_NODE_RANK") else 0

    def main_address(self) -> str | None:
        return self.env.get("PET_MASTER_ADDR") or None

    def main_port(self) -> int:
        return read_port(self.env, "PET_MASTER_PORT") if self._given("PET_MASTER_PORT") else 29500

    def rdzv_endpoint(self) -> str | None:
        return self.env.get("PET_RDZV_ENDPOINT") or super().rdzv_endpoint()

    def nproc_per_node(self) -> int | None:
        if self.env.get("PET_NPROC_PER_NODE", "auto") == "auto":
            return None
        return self._int("PET_NPROC_PER_NODE", minimum=1)


class SLURM(ClusterEnvironment):
    """SLURM: a launcher per node inside an ``srun`` step (one task per node), or ranks started by ``srun``
    directly (``SLURM_PROCID``...). Host lists are parsed, never expanded (:mod:`multigpu.runtime.hostlist`).

    An ``sbatch`` script's own shell carries ``SLURM_NNODES`` too, but no step (``SLURM_STEP_ID``): there only one
    launcher runs, so it is not taken for a node of a multi-node job."""

    name = "SLURM"

    @classmethod
    def detect_node(cls, env: Mapping[str, str]) -> bool:
        return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env

    @classmethod
    def detect_rank(cls, env: Mapping[str, str]) -> bool:
        return "SLURM_PROCID" in env and "SLURM_NTASKS" in env

    def _nodelist(self) -> tuple[str, str]:
        variable = "SLURM_JOB_NODELIST" if self._given("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
        return variable, self.env.get(variable) or ""

    def first_host(self) -> str | None:
        from multigpu.runtime.hostlist import first_host

        variable, text = self._nodelist()
        return first_host(text, variable)

    def tasks_per_node(self) -> tuple[int, str] | None:
        """(tasks per node, the variable that says it) of this step; None where none does."""
        name = next((n for n in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE") if self._given(n)), None)
        return (self._int(name, minimum=1, slurm_count=True), name) if name else None

    def nnodes(self) -> int:
        from multigpu.runtime.hostlist import count_hosts

        if self._given("SLURM_NNODES"):
            return self._int("SLURM_NNODES", minimum=1)
        variable, text = self._nodelist()
        return max(count_hosts(text, variable), 1)

    def node_rank(self) -> int:
        return self._int("SLURM_NODEID") if self._given("SLURM_NODEID") else 0

    def main_address(self) -> str | None:
        return self.env.get("MASTER_ADDR") or self.first_host()

    def main_port(self) -> int:
        if self._given("MASTER_PORT"):
            return read_port(self.env, "MASTER_PORT")
        return slurm_master_port(self.env.get("SLURM_JOB_ID"))

    def nproc_per_node(self) -> int | None:
        """GPUs per node from ``SLURM_GPUS_ON_NODE``, else the count of ``SLURM_GPUS_PER_NODE`` (``h100:4``)."""
        if self._given("SLURM_GPUS_ON_NODE"):
            name, text = "SLURM_GPUS_ON_NODE", self.env["SLURM_GPUS_ON_NODE"]
        elif self._given("SLURM_GPUS_PER_NODE"):
            name, text = "SLURM_GPUS_PER_NODE", self.env["SLURM_GPUS_PER_NODE"].rpartition(":")[2]
        else:
            return None
        return read_int({name: text}, name, slurm_count=True) or None

    # the ranks (srun started them directly)
    def global_rank(self) -> int:
        return self._int("SLURM_PROCID")

    def world_size(self) -> int:
        return self._int("SLURM_NTASKS")

    def local_rank(self) -> int:
        return self._int("SLURM_LOCALID") if "SLURM_LOCALID" in self.env else 0

    def local_world_size(self) -> int:
        for name in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if self._given(name):
                return self._int(name, minimum=1, slurm_count=True)  # "4(x2)": 4 tasks on each of 2 nodes
        return self.world_size()

    def group_rank(self) -> int:
        return self._int("SLURM_NODEID") if "SLURM_NODEID" in self.env else 0

    def rank_main_address(self) -> str | None:
        return self.env.get("MASTER_ADDR") or self.first_host() or "127.0.0.1"

    def rank_main_port(self) -> int:
        return self.main_port()


_RANK_FILE_MAX_BYTES = 16 << 20
"""LSF's rank file lists one line per task slot: a few MB at most on the largest machines."""


class LSF(ClusterEnvironment):
    """IBM Spectrum LSF (``jsrun``/``blaunch``): the hosts of ``LSB_DJOB_RANKFILE``, the first line (the launch
    node) left out; this node is this host's place among them."""

    name = "LSF"

    @classmethod
    def detect_node(cls, env: Mapping[str, str]) -> bool:
        return bool(env.get("LSB_JOBID") and env.get("LSB_DJOB_RANKFILE"))

    def __init__(self, env: Mapping[str, str], hostname: str | None = None):
        super().__init__(env, hostname)
        self._hosts: list[str] | None = None

    def hosts(self) -> list[str]:
        if self._hosts is None:
            self._hosts = self._read_rank_file()
        return self._hosts

    def _read_rank_file(self) -> list[str]:
        path = self.env["LSB_DJOB_RANKFILE"]
        try:
            # never open a FIFO or a device (opening a FIFO blocks until someone writes to it): a regular file only
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ConfigError(f"LSB_DJOB_RANKFILE={path} is not a regular file (LSF writes one host name per "
                                      "line there); valid: the rank file LSF wrote, or unset LSB_DJOB_RANKFILE")
                with os.fdopen(os.dup(fd), "rb") as fh:
                    data = fh.read(_RANK_FILE_MAX_BYTES + 1)
            finally:
                os.close(fd)
        except OSError as exc:
            raise ConfigError(f"LSB_DJOB_RANKFILE={path} cannot be read: {exc.strerror}") from None
        if len(data) > _RANK_FILE_MAX_BYTES:
            raise ConfigError(f"LSB_DJOB_RANKFILE={path} is larger than {_RANK_FILE_MAX_BYTES >> 20} MiB, which no "
                              "rank file is; valid: the rank file LSF wrote")
        lines = [line.strip() for line in data.decode("utf-8", errors="replace").splitlines() if line.strip()]
        return list(dict.fromkeys(lines[1:] or lines))  # the first line is LSF's launch node, not a compute node

    def nnodes(self) -> int:
        return len(self.hosts())

    def node_rank(self) -> int:
        hosts, me = self.hosts(), self.hostname or socket.gethostname()
        if me not in hosts:
            raise ConfigError(f"this host ({me}) is not in LSF's rank file {self.env['LSB_DJOB_RANKFILE']} "
                              f"({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})")
        return hosts.index(me)

    def main_address(self) -> str | None:
        return self.hosts()[0] if self.hosts() else None

    def main_port(self) -> int:
        if self._given("MASTER_PORT"):
            return read_port(self.env, "MASTER_PORT")
        return slurm_master_port(self.env.get("LSB_JOBID"))


class OpenMPI(ClusterEnvironment):
    """``mpirun -N 1 multigpu launch ...``: one launcher per node; MPI names no rendezvous host, so
    ``MASTER_ADDR`` (and ``MASTER_PORT``) must say it."""

    name = "Open MPI"

    @classmethod
    def detect_node(cls, env: Mapping[str, str]) -> bool:
        return "OMPI_COMM_WORLD_SIZE" in env

    def nnodes(self) -> int:
        return self._int("OMPI_COMM_WORLD_SIZE", minimum=1)

    def node_rank(self) -> int:
        return self._int("OMPI_COMM_WORLD_RANK")

    def main_address(self) -> str:
        if not self.env.get("MASTER_ADDR"):
            raise ConfigError("started by mpirun (OMPI_COMM_WORLD_SIZE is set) but MASTER_ADDR is not: MPI names no "
                              "rendezvous host; set MASTER_ADDR (and MASTER_PORT) or pass --rdzv-endpoint HOST:PORT")
        return self.env["MASTER_ADDR"]

    def main_port(self) -> int:
        return read_port(self.env, "MASTER_PORT") if self._given("MASTER_PORT") else 29500


NODE_ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (Kubeflow, SLURM, LSF, OpenMPI)
"""Asked in this order by the launcher (the first that detects this node wins)."""
RANK_ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (TorchElastic, SLURM, Local)
"""Asked in this order by a rank."""


def node_environment(env: Mapping[str, str], hostname: str | None = None) -> ClusterEnvironment | None:
    """The environment that started this node's launcher, or None (no scheduler: the flags and defaults)."""
    found = next((cls for cls in NODE_ENVIRONMENTS if cls.detect_node(env)), None)
    return found(env, hostname) if found is not None else None


def rank_environment(env: Mapping[str, str]) -> ClusterEnvironment:
    """The environment that started this rank (:class:`Local` when none did)."""
    return next(cls for cls in RANK_ENVIRONMENTS if cls.detect_rank(env))(env)
