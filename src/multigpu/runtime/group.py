"""Joining and leaving the job: ``init()``, ``shutdown()`` and the accessors (inside each rank).

``init()`` reads where this process stands (torchrun, SLURM, or alone), picks
its device and the process-group backend, sets the thread budget and the
seeds, and creates the process group with a timeout so that no collective
waits forever. A single process is ``world_size == 1`` of the same code: no
process group of ours is created and every collective is the identity (a user's script started by a
launcher with one process still gets torch's default group of one rank, as torchrun gives it, so
``DistributedSampler`` and DDP work at 1 rank as at N).

Rank variables without a launcher (``WORLD_SIZE=2 RANK=0`` left in a shell,
``SLURM_PROCID`` in an ``sbatch`` script run without ``srun``) would make
``init`` wait the whole timeout for ranks that never come. So: torchrun-style
variables without ``MASTER_ADDR``/``MASTER_PORT`` are refused at once, in one
line naming what was found; with them, and for SLURM's, ``init`` says in one
line what it found and waits at most :data:`NO_LAUNCHER_WAIT_S` (or
``timeout_s`` when given) for the other ranks, then stops with one line.

Under ``multigpu launch`` on one node the ranks meet through a FileStore in a
folder only the job's user can open (``run.json``'s ``private_store``), not through the
workers' TCP store on loopback, which any local user can connect to and write;
a script that calls ``torch.distributed.init_process_group`` itself
still uses the TCP store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import random
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from multigpu.errors import CollectiveTimeoutError, ConfigError, DeviceError, NotInitializedError
from multigpu.runtime import calls, context, watchdog
from multigpu.runtime.device import DeviceFacts, choose_backend, select_device
from multigpu.runtime.env import (
    LAUNCHER_VARIABLES,
    cpu_count,
    found_variables,
    launcher_variable,
    read_placement,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistEnv",
    "alone",
    "backend",
    "device",
    "enable_group_of_one",
    "get_env",
    "init",
    "is_initialized",
    "is_main",
    "current_device",
    "exchange_group",
    "host_group",
    "local_rank",
    "monitor_group",
    "node_rank",
    "rank",
    "shutdown",
    "thread_budget",
    "timeout_s",
    "world_size",
]

DEFAULT_TIMEOUT_S = 600.0
"""Collective timeout when neither ``init(timeout_s=...)`` nor the launcher's ``--timeout-s`` says otherwise."""

NO_LAUNCHER_WAIT_S = 60.0
"""How long ``init`` waits for the other ranks when rank variables are set but no launcher is there
(:func:`multigpu.runtime.env.launcher_variable`); ``init(timeout_s=...)`` sets another wait."""


@dataclasses.dataclass(frozen=True)
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
        shutdown(barrier=exc_type is None)


_ENV: DistEnv | None = None
_INIT_ARGS: dict | None = None
_TIMEOUT_S: float = DEFAULT_TIMEOUT_S
_MONITOR_GROUP = None  # a gloo group beside an NCCL default group: monitored_barrier, collectives' metadata
_EXCHANGE_GROUP = None  # a gloo group for point-to-point exchanges on a side thread (NCCL jobs), made on first use
_GROUP_OF_ONE = False  # the test harness's switch: a real process group at world size 1 (see enable_group_of_one)


def enable_group_of_one() -> None:
    """Test harness only (``run_on_ranks(fn, 1, group_of_one=True)``): the next :func:`init` at world size 1
    creates a real process group (NCCL on a GPU, else gloo), and collectives, point-to-point exchanges
    (through a loopback, :class:`Loopback`) and the workloads take their multi-rank paths, so a one-GPU
    machine runs the NCCL code. Nothing a user runs calls this; :func:`shutdown` clears it."""
    global _GROUP_OF_ONE
    _GROUP_OF_ONE = True


def thread_budget(local_world_size: int, threads: int | None = None, env: dict | None = None) -> int:
    """Threads for one rank: ``threads`` if given, else ``OMP_NUM_THREADS``, else ``cores // local_world_size``."""
    env = os.environ if env is None else env
    if threads is not None:
        if threads < 1:
            raise ConfigError(f"threads={threads} must be >= 1")
        return threads
    raw = env.get("OMP_NUM_THREADS")
    if raw and raw.isdigit() and int(raw) > 0:
        return int(raw)
    return max(1, cpu_count() // max(1, local_world_size))


def _seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:  # numpy is a core dependency, but the runtime itself does not need it
        pass


def _resolve_timeout(timeout_s: float | None, ctx: context.RunContext) -> float:
    value = timeout_s if timeout_s is not None else ctx.timeout_s if ctx.timeout_s is not None else DEFAULT_TIMEOUT_S
    if not value > 0:
        raise ConfigError(f"timeout_s={value} must be > 0 seconds")
    return context.clamp_timeout(value)  # longer: torch's and gloo's clocks overflow (context.MAX_TIMEOUT_S)


def init(
    backend: str = "auto",
    *,
    seed: int | None = None,
    seed_per_rank: bool = False,
    timeout_s: float | None = None,
    threads: int | None = None,
    init_method: str | None = None,
) -> DistEnv:
    """Join the job and return this rank's :class:`DistEnv`. Call on all ranks, once, at the start.

    Idempotent: a second call returns the same ``DistEnv``; if its arguments
    differ from the first call's, it warns that they do not take effect.

    Args:
        backend: "auto" (CUDA, then MPS, then CPU), "cuda", "mps" or "cpu".
        seed: Seed Python's, NumPy's and torch's generators. ``None`` leaves them alone.
        seed_per_rank: False (default): every rank gets ``seed`` (the same stream,
            which identical model initialisation under DDP needs). True: rank r
            gets ``seed + r`` (different dropout masks or augmentations per rank).
        timeout_s: Timeout of every collective, in seconds (default
            the launcher's ``--timeout-s``, else 600). A collective that exceeds it raises
            instead of hanging.
        threads: CPU threads for this rank; default ``OMP_NUM_THREADS`` if set,
            else ``max(1, cores // local_world_size)``.
        init_method: Where the ranks meet, as torch's ``init_process_group`` takes it
            (``file:///shared/store``, ``tcp://host:port``); the rank variables still give
            rank and world size. None (default): the launcher's rendezvous (``MASTER_ADDR``
            and ``MASTER_PORT``, or SLURM's).

    Example (world_size=2)::

        env = mg.init(seed=0)   # rank 0 -> DistEnv(rank=0, ..., device=cpu, backend='gloo')
                                # rank 1 -> DistEnv(rank=1, ...)
    """
    global _ENV, _INIT_ARGS, _TIMEOUT_S, _MONITOR_GROUP
    args = dict(backend=backend, seed=seed, seed_per_rank=seed_per_rank, timeout_s=timeout_s, threads=threads,
                init_method=init_method)
    if _ENV is not None:
        if args != _INIT_ARGS:
            changed = ", ".join(f"{k}={v!r}" for k, v in args.items() if _INIT_ARGS.get(k) != v)
            warnings.warn(
                f"multigpu.init() was already called; the new settings ({changed}) will not take effect. "
                "Call multigpu.shutdown() first to re-initialise.",
                stacklevel=2,
            )
        return _ENV

    placement = read_placement()
    ctx = context.current()
    facts = DeviceFacts.probe(ctx)
    dev = select_device(backend, placement.local_rank, facts)
    as_ranks = 2 if _GROUP_OF_ONE and placement.world_size == 1 else placement.world_size
    pg_backend = choose_backend(dev, as_ranks, facts, ctx.pg_backend)
    _TIMEOUT_S = _resolve_timeout(timeout_s, ctx)

    torch.set_num_threads(thread_budget(placement.local_world_size, threads))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if seed is not None:
        _seed_all(seed + placement.rank if seed_per_rank else seed)

    if pg_backend != "none" and not dist.is_initialized():
        _init_process_group(pg_backend, placement, dev, init_method, wait_s=timeout_s or NO_LAUNCHER_WAIT_S)
    elif placement.world_size == 1 and not dist.is_initialized() and _launched_script():
        _torch_group_of_one(dev)
    if pg_backend == "nccl":
        _MONITOR_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=_TIMEOUT_S))
    if ctx.stall_timeout_s is not None:
        watchdog.start(placement.rank, ctx.stall_timeout_s)

    _ENV = DistEnv(
        rank=placement.rank,
        local_rank=placement.local_rank,
        world_size=placement.world_size,
        local_world_size=placement.local_world_size,
        node_rank=placement.node_rank,
        device=dev,
        backend=pg_backend,
    )
    _INIT_ARGS = args
    return _ENV


def _init_process_group(pg_backend: str, placement, dev: torch.device, init_method: str | None, *,
                        wait_s: float) -> None:
    # the caller's (the test harness's file:///tmp/x/store), else the launcher's private folder on one node
    init_method = init_method or _private_store()
    found = found_variables(placement.source)
    if init_method is None and (placement.master_addr is None or placement.master_port is None):
        raise ConfigError(f"multigpu.init(): {found} say this is one of {placement.world_size} ranks, but MASTER_ADDR "
                          "and MASTER_PORT are not both set, so the ranks cannot meet (leftover variables?); valid: "
                          "unset RANK and WORLD_SIZE to run as one process, or start the script with `multigpu "
                          "launch` or torchrun")
    kwargs = dict(
        backend="cpu:gloo,cuda:nccl" if pg_backend == "nccl" else "gloo",
        timeout=timedelta(seconds=_TIMEOUT_S),
        rank=placement.rank,
        world_size=placement.world_size,
    )
    if pg_backend == "nccl":
        kwargs["device_id"] = dev
    # torch.distributed.nn.functional binds ``group=group.WORLD`` as default arguments when it is first imported.
    # Imported after the group exists (DDP imports it through torch._dynamo), those defaults hold the default group
    # for the life of the process: destroy_process_group() in shutdown() then frees nothing, and gloo's threads run
    # on into the interpreter's exit, where the group is freed, if at all, while Python is torn down (an rl rank
    # aborted there once: "terminate called without an active exception"). Imported now, the defaults are None.
    import torch.distributed.nn  # noqa: F401
    if init_method is None and launcher_variable() is None:
        dist.init_process_group(store=_store_without_launcher(placement, found, wait_s), **kwargs)
        return
    if init_method is None and placement.source == "slurm":
        init_method = f"tcp://{placement.master_addr}:{placement.master_port}"
    try:
        dist.init_process_group(init_method=init_method or "env://", **kwargs)
        if pg_backend == "nccl":  # create the communicator now, so that a bad placement fails here, said plainly
            dist.all_reduce(torch.zeros(1, device=dev))
    except RuntimeError as exc:  # DistBackendError is a RuntimeError
        advice = nccl_advice(str(exc), placement.rank, dev)
        if advice is None:
            raise
        raise DeviceError(advice) from None


def _launched_script() -> bool:
    """A user's script started by a launcher (``multigpu launch``/``bench``/``verify``, torchrun, srun), not a
    workload of ours nor a process run alone."""
    if launcher_variable() is None:
        return False
    path = os.environ.get(context.RUN_FILE_VAR)
    return not (path and context.read_run_file(path).get("workload"))


def _torch_group_of_one(dev: torch.device) -> None:
    """torch's default process group of this one rank, as torchrun gives a script started with one process:
    ``DistributedSampler``, ``DistributedDataParallel`` and ``dist.get_world_size()`` work unchanged, so a
    torchrun script runs at world size 1 (``bench``'s baseline, ``verify``'s reference) as at N. multigpu's
    own collectives stay identities (the backend is "none"). The store is in this process: nothing to meet."""
    import torch.distributed.nn  # noqa: F401  (before the group exists: see _init_process_group)

    dist.init_process_group("cpu:gloo,cuda:nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(),
                            rank=0, world_size=1, timeout=timedelta(seconds=_TIMEOUT_S))


def _private_store() -> str | None:
    """A FileStore in the launcher's private folder, a fresh one per attempt (a restarted group must not read
    the previous attempt's keys); None where the launcher gave no folder."""
    path = os.environ.get(context.RUN_FILE_VAR)
    folder = context.read_run_file(path).get("private_store") if path else None
    if not folder:
        return None
    from multigpu.runtime.env import restart_count

    return f"file://{folder}/attempt{restart_count()}"


def nccl_advice(message: str, rank: int, dev: torch.device) -> str | None:
    """One line of advice for NCCL's refusal of two ranks on one GPU (None for any other error)."""
    if "duplicate gpu" not in message.lower():  # NCCL: "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device ..."
        return None
    return (f"NCCL refused rank {rank} on {dev}: NCCL allows one rank per GPU, and another rank of this job uses "
            "the same GPU; valid: one rank per GPU (--nproc-per-node at most the GPU count), --allow-cpu-ranks, "
            "--cpu, or --share-gpus to let ranks share a GPU over gloo")


def _store_without_launcher(placement, found: str, wait_s: float) -> dist.Store:
    """The rendezvous store when rank variables are set but no launcher is there: say so, wait ``wait_s`` at most.

    Rank 0 serves the store and waits for every rank to connect; the others knock on its port quietly
    (a plain socket, so torch's client does not log each retry) until it opens.
    """
    import socket
    import sys
    import time

    host, port = placement.master_addr, placement.master_port
    print(f"multigpu.init(): {found} are set but no launcher is ({', '.join(LAUNCHER_VARIABLES[:2])} and "
          f"SLURM_STEP_ID are not); waiting at most {wait_s:g} s for the other {placement.world_size - 1} rank(s) at "
          f"{host}:{port}", file=sys.stderr, flush=True)
    late = (f"multigpu.init(): the other rank(s) did not join at {host}:{port} within {wait_s:g} s; {found} look "
            "like leftover variables: unset them to run as one process, or start every rank with `multigpu "
            "launch` or torchrun (mg.init(timeout_s=...) waits longer)")
    deadline = time.monotonic() + wait_s
    if placement.rank != 0:
        while True:
            try:
                socket.create_connection((host, port), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise CollectiveTimeoutError(late) from None
                time.sleep(0.2)
    left = max(deadline - time.monotonic(), 1.0)
    try:
        store = dist.TCPStore(host, port, placement.world_size, placement.rank == 0,
                              timeout=timedelta(seconds=left), wait_for_workers=True)
    except dist.DistError as exc:
        if placement.rank == 0 and "waiting for clients" not in str(exc):
            raise ConfigError(f"multigpu.init(): cannot serve the rendezvous at {host}:{port} ({found}): "
                              f"{str(exc).strip().splitlines()[0]}") from None
        raise CollectiveTimeoutError(late) from None
    store.set_timeout(timedelta(seconds=_TIMEOUT_S))  # from here on, the collective timeout
    return store


def shutdown(*, barrier: bool = True) -> None:
    """Leave the job: a barrier (so no rank tears down while others still talk), then destroy the group.

    Call on all ranks. Safe to call when not initialised, and twice.
    """
    global _ENV, _INIT_ARGS, _MONITOR_GROUP, _EXCHANGE_GROUP, _GROUP_OF_ONE
    watchdog.stop()
    if _ENV is not None and _ENV.world_size > 1 and dist.is_initialized() and barrier:
        calls.barrier(_ENV.rank, _ENV.world_size, _TIMEOUT_S, monitor=_MONITOR_GROUP,
                      monitored=_ENV.backend == "gloo")
    if dist.is_initialized():
        # a DDP model its workload dropped is a reference cycle that still holds the group (its reducer): collect
        # it here, on this thread, before the group is destroyed and after. Otherwise the collector may run first
        # on one of gloo's own threads (a comm hook's callback allocating), free the group there and join that
        # very thread ("terminate called after throwing ... Resource deadlock avoided", once in a full run), or
        # run into the interpreter's exit with gloo's threads alive
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
    _ENV = None
    _INIT_ARGS = None
    _MONITOR_GROUP = _EXCHANGE_GROUP = None
    _GROUP_OF_ONE = False


@contextlib.contextmanager
def alone():
    """Inside, this rank works as a job of one: ``world_size()`` is 1, ``rank()`` 0, ``backend()`` "none", so
    every collective of ours is the identity; its device, threads and process group are kept, and ``rank()``
    and ``world_size()`` are the job's again on leaving. Not a collective: each rank enters when it likes.

    Simulation ensembles run a whole replicate on one rank this way (the same code as a one-process run,
    so the same result); code inside must not call ``torch.distributed`` on the default group itself.

    Example (world_size=2)::

        with group.alone():
            group.world_size(), group.rank()   # rank 0 -> (1, 0); rank 1 -> (1, 0)
    """
    global _ENV
    outer = _ENV
    if outer is None or outer.world_size == 1 and outer.backend == "none":
        yield
        return
    _ENV = dataclasses.replace(outer, rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                               backend="none")
    try:
        yield
    finally:
        _ENV = outer


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _ENV is not None


def get_env(caller: str = "get_env") -> DistEnv:
    """This rank's :class:`DistEnv`; raises :class:`NotInitializedError` before :func:`init`."""
    if _ENV is None:
        raise NotInitializedError(
            f"{caller}() was called before multigpu.init(). "
            "Call multigpu.init() at the start of main(), or run the script with `multigpu launch`."
        )
    return _ENV


def _placement_or_env():
    return _ENV if _ENV is not None else read_placement()


def rank() -> int:
    """Global rank of this process (0 before :func:`init` when not launched)."""
    return _placement_or_env().rank


def local_rank() -> int:
    """Rank of this process on its node."""
    return _placement_or_env().local_rank


def world_size() -> int:
    """Number of processes in the job."""
    return _placement_or_env().world_size


def node_rank() -> int:
    """Index of this process's node in the job: its worker group's rank (torchrun's ``GROUP_RANK``, SLURM's
    ``SLURM_NODEID``; :meth:`~multigpu.runtime.clusters.ClusterEnvironment.group_rank`)."""
    return _placement_or_env().node_rank


def is_main() -> bool:
    """True on rank 0 (the rank that owns logs, checkpoints and reports)."""
    return rank() == 0


def device() -> torch.device:
    """This rank's device: the one :func:`init` chose; before it, the one it would choose (the rank's GPU, else
    MPS, else the CPU), so a script can replace ``torch.cuda.set_device(local_rank)`` and ``"cuda:N"`` with it
    whether or not it calls :func:`init`. A GPU is also made the current CUDA device, as ``init`` and
    ``torch.cuda.set_device`` do (what ``.cuda()``, NCCL and CUDA streams use). ``str(device())`` is the string
    scripts that test ``'cuda' in device`` (nanoGPT) want: ``'cuda:1'``, ``'cpu'``."""
    if _ENV is not None:
        return _ENV.device
    dev = select_device("auto", read_placement().local_rank, DeviceFacts.probe(context.current()))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def current_device() -> torch.device:
    """This rank's device after :func:`init`; the CPU before it (code that also runs outside a job)."""
    return _ENV.device if _ENV is not None else torch.device("cpu")


def backend() -> str:
    """The process-group backend: "nccl", "gloo", or "none" for a single process."""
    return get_env("backend").backend


def timeout_s() -> float:
    """The collective timeout in force, in seconds."""
    return _TIMEOUT_S


def monitor_group():
    """A gloo group usable by ``monitored_barrier`` (the default group when it is gloo)."""
    return _MONITOR_GROUP


def host_group():
    """The gloo group for small host-side collectives (shapes, dtypes): ``None`` (the default group) on gloo
    jobs, the gloo group made beside NCCL on NCCL jobs, so they never wait on a CUDA stream."""
    return _MONITOR_GROUP


class Loopback:
    """A point-to-point "group" of one process with itself: two gloo process groups of size 2 in this process,
    joined over a local store, one that sends and one that receives (gloo has no pair to itself, and NCCL
    serializes a send and a receive to itself on one stream). Made only by the test harness's group of one."""

    def __init__(self, timeout_s: float):
        from concurrent.futures import ThreadPoolExecutor

        store = dist.HashStore()
        with ThreadPoolExecutor(2) as pool:  # each end waits in its constructor until the other connects
            self.sender, self.receiver = pool.map(
                lambda r: dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=timeout_s)), (0, 1))

    def route(self, peer: int, *, sending: bool):
        """``(process group, peer's rank in it)`` for a send to, or a receive from, this process (rank ``peer``)."""
        return (self.sender, 1) if sending else (self.receiver, 0)


def exchange_group():
    """The group for point-to-point exchanges of CPU tensors run on a side thread (inference's receiver).

    Call on all ranks the first time: on NCCL jobs it makes a gloo group of every rank, kept until
    :func:`shutdown`. A receive over NCCL makes the calling thread's CUDA stream (the default one, which
    the main thread's kernels share) wait for a peer that may send much later; over gloo only the
    receiving thread waits. gloo jobs: ``None``, the default group. The harness's group of one: a
    :class:`Loopback`.
    """
    global _EXCHANGE_GROUP
    env = get_env("exchange_group")
    if env.world_size == 1 and env.backend != "none":
        if _EXCHANGE_GROUP is None:
            _EXCHANGE_GROUP = Loopback(_TIMEOUT_S)
        return _EXCHANGE_GROUP
    if env.backend != "nccl":
        return None
    if _EXCHANGE_GROUP is None:
        _EXCHANGE_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=_TIMEOUT_S))
    return _EXCHANGE_GROUP
