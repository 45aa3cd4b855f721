"""Which GPUs the job uses and what each worker sees (pure; runs in the launcher).

``plan_devices(cfg, facts)`` turns ``--gpus``, ``--nproc-per-node``, ``--cpu``,
``--isolate-devices`` and ``--allow-cpu-ranks`` into the number of workers and
the variables they inherit. GPU indices in ``--gpus`` count the GPUs this
process can see; when ``CUDA_VISIBLE_DEVICES`` is already set they are mapped
through it, so ``CUDA_VISIBLE_DEVICES=2,3 multigpu launch --gpus 1`` uses
physical GPU 3.

NCCL allows one rank per GPU. More ranks than selected GPUs is an error that
names the choices, unless the extra ranks run on the CPU (``--allow-cpu-ranks``)
or the ranks share the GPUs (``--share-gpus``): then they are placed
round-robin, each worker pinned to its GPU as under ``--isolate-devices``, and
the job's collectives run on gloo.

It also refuses what cannot fit before anything starts: more ranks than this
node's memory holds at :data:`RANK_RESIDENT_BYTES` each (one line, exit 2, with
the largest count that fits), and it warns when CPU ranks outnumber the cores.
Workloads check their own data against :meth:`DevicePlan.memory_per_rank`.
"Available memory" is the tighter of the host's and this process's cgroup's
(v1 or v2, its limit less its working set: :mod:`multigpu.launch.memlimit`),
and each rank's share is also capped by ``RLIMIT_AS``; messages name which.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from multigpu import envvars
from multigpu.errors import ConfigError, DeviceError
from multigpu.launch import heap
from multigpu.launch._worker import DEVICE_VARIABLES
from multigpu.launch.config import LaunchConfig
from multigpu.launch.memlimit import RANK_MAPPED_BYTES
from multigpu.units import format_bytes

__all__ = ["DEVICE_VARIABLES", "RANK_RESIDENT_BYTES", "DevicePlan", "HostFacts", "configs_for", "parse_gpus",
           "plan_devices"]

GLOO_GROUP_BYTES = 192 << 20
"""Address space a rank maps beyond torch for its gloo process group and DDP's buffers before it holds any data.
Measured here (torch 2.13, 2 CPU ranks, one thread each): a rank maps 628 MiB with torch loaded, 764 MiB at the
peak of ``mg.init`` (the gloo group) without a limit; under ``ulimit -v`` a DDP step on gloo ran from 805000 KiB
(786 MiB) and died below (790000: "SystemError: error return without exception set", 800000: a MemoryError in
DDP, once in two), so it needs about 160 MiB above torch; 192 with a margin."""
THREAD_MAPPED_BYTES = 72 << 20
"""Address space each further compute thread of a rank reserves: its malloc arena (64 MiB, glibc) and its stack
(8 MiB). Measured here: a rank's VmSize grew from 0.6 GiB to 1.2 GiB between 1 and 8 OMP threads."""

RANK_RESIDENT_BYTES = 200 << 20
"""Memory a rank holds before it holds any data: a Python process with torch imported and a gloo group
(measured: 150-200 MiB of its own pages, USS, on CPU; a CUDA context adds more). A lower bound, so
the check below never refuses a job that would fit."""


@dataclass(frozen=True)
class HostFacts:
    """What the launcher can see: GPU count, the inherited CUDA_VISIBLE_DEVICES, cores, memory.

    Tests inject their own (``HostFacts(gpu_count=0, cores=2, available_bytes=1 << 30)``): a memory
    limit is tested with a made-up figure, never by filling the machine. None: not known, not checked.
    """

    gpu_count: int
    visible: str | None = None
    cores: int = 1
    memory_bytes: int | None = None
    """Total memory of this node."""
    available_bytes: int | None = None
    """Memory available to new processes now (psutil's ``available``: free plus reclaimable cache)."""
    gpu_memory_bytes: int | None = None
    """Memory of the smallest visible GPU of this node (NVML, when installed), for data that lives on the GPU."""
    gpu_memories: tuple[int, ...] | None = None
    """Total memory of each visible GPU, in visible order (NVML, when installed; None: unknown). The plan takes the
    smallest of the GPUs it selects."""
    gpu_capabilities: tuple[tuple[int, int], ...] | None = None
    """CUDA compute capability of each visible GPU, in visible order (NVML, when installed; None: unknown)."""
    memory_source: str | None = None
    """Where ``available_bytes`` comes from when not the host's: ``the 6 GiB cgroup v2 memory.max of /sys/...``."""
    address_space_bytes: int | None = None
    """``RLIMIT_AS`` (``ulimit -v``): each rank's own address space, None: unlimited."""
    mapped_bytes: int | None = None
    """Address space the launcher maps (its VmSize, torch imported as in every rank); None: unknown."""

    @classmethod
    def probe(cls) -> HostFacts:
        """The real host (tests pass their own ``HostFacts`` instead, or replace this method)."""
        import psutil
        import torch

        from multigpu.launch import memlimit
        from multigpu.runtime.env import cpu_count

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        vm = psutil.virtual_memory()
        available, source, limit = vm.available, None, memlimit.cgroup_memory()
        if limit is not None and limit.available_bytes < available:  # a container, SLURM or Kubernetes job
            available, source = limit.available_bytes, f"the {format_bytes(limit.limit_bytes)} {limit.source}"
        facts = cls(gpu_count=count, visible=os.environ.get("CUDA_VISIBLE_DEVICES"), cores=cpu_count(),
                    memory_bytes=vm.total, available_bytes=available, memory_source=source,
                    address_space_bytes=memlimit.address_space_limit(), mapped_bytes=memlimit.mapped_bytes())
        if not count:
            return facts
        ids = facts.physical_ids()
        memories = _gpu_memories(ids)
        return replace(facts, gpu_capabilities=_gpu_capabilities(ids), gpu_memories=memories,
                       gpu_memory_bytes=min(memories) if memories else None)

    @property
    def memory_words(self) -> str:
        """Where the available figure comes from, for messages."""
        return f"under {self.memory_source}" if self.memory_source else "on this machine"

    def physical_ids(self) -> list[str]:
        """The id to write into CUDA_VISIBLE_DEVICES for each visible GPU index."""
        if self.visible:
            ids = [v.strip() for v in self.visible.split(",") if v.strip()]
            if len(ids) >= self.gpu_count:
                return ids[: self.gpu_count]
        return [str(i) for i in range(self.gpu_count)]


@dataclass(frozen=True)
class DevicePlan:
    nproc_per_node: int
    gpu_ids: list[str]
    """Physical id of the GPU of local rank i, for the ranks that have one."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables every worker inherits (per-rank pinning is done by the worker wrapper)."""
    note: str | None = None
    """A line for the user (e.g. the CPU fallback)."""
    isolated: bool = False
    """Each worker sees only its GPU (``--isolate-devices``)."""
    hybrid: bool = False
    """Some ranks run on the CPU beside GPU ranks (``--allow-cpu-ranks``): gloo everywhere."""
    shared: bool = False
    """Several ranks share one GPU (``--share-gpus``): gloo everywhere."""
    gpu_ranks: int | None = None
    """A hybrid job: the local ranks below this have a GPU; the worker wrapper hides every GPU from the others
    (it reads this from the run file, ``run.json``'s ``gpu_ranks``, before anything is imported)."""

    available_bytes: int | None = None
    """Memory available on this node when the job was planned (None: unknown)."""
    gpu_memory_bytes: int | None = None
    """Memory of the smallest GPU this node's ranks run on (None: unknown, or no GPU)."""
    gpu_capability: tuple[int, int] | None = None
    """The lowest CUDA compute capability of the selected GPUs (NVML; None: unknown, or no GPU). The launcher
    decides bf16 support from it without creating a CUDA context."""
    memory_source: str | None = None
    """As :attr:`HostFacts.memory_source`: a cgroup limit, or None for the host's available memory."""
    address_space_bytes: int | None = None
    """``RLIMIT_AS`` of each rank (None: unlimited)."""
    rank_mapped_bytes: int = RANK_MAPPED_BYTES
    """Address space a rank of this plan maps before it holds any data (:func:`rank_mapped`)."""

    @property
    def device_types(self) -> list[str]:
        """The device types this node's ranks compute on: ["cuda"], ["cpu"] or both (hybrid)."""
        return (["cuda"] if self.gpu_ids else []) + (["cpu"] if len(self.gpu_ids) < self.nproc_per_node else [])

    def memory_per_rank(self, device_type: str = "cpu") -> int | None:
        """Bytes one rank of this node may fill with data: host memory beyond a rank's own
        (``available / nproc - RANK_RESIDENT_BYTES``, available as the cgroup allows) and within its
        ``RLIMIT_AS`` for ``"cpu"``, the smallest GPU the ranks run on for ``"cuda"``."""
        if device_type == "cuda":
            return self.gpu_memory_bytes
        shares = [] if self.available_bytes is None else [
            max(self.available_bytes // self.nproc_per_node - RANK_RESIDENT_BYTES, 0)]
        if self.address_space_bytes is not None:
            shares.append(max(self.address_space_bytes - self.rank_mapped_bytes, 0))
        return min(shares) if shares else None

    def memory_words(self, device_type: str = "cpu") -> str:
        """What bounds :meth:`memory_per_rank`, for messages: ``rank (...)``."""
        if device_type == "cuda":
            return "GPU"
        per = None if self.available_bytes is None else self.available_bytes // self.nproc_per_node - RANK_RESIDENT_BYTES
        if self.address_space_bytes is not None and (per is None or self.address_space_bytes - self.rank_mapped_bytes < per):
            return f"rank (its RLIMIT_AS, ulimit -v, of {format_bytes(self.address_space_bytes)})"
        if self.memory_source:
            return f"rank (the memory left under {self.memory_source}, over its ranks)"
        return "rank (this machine's available memory over its ranks)"


def _nvml_query(query):
    """``query(pynvml)`` between NVML's init and shutdown (``nvidia-ml-py``, optional); None without it, without a
    driver, or when NVML does not know what was asked (unknown, so not checked here).

    NVML, not torch: asking torch would create a CUDA context in the launcher (on GPU 0, for the whole job)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return query(pynvml)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no device, an id NVML does not know
        return None


def _handles(nvml, ids: list[str]) -> list:
    """NVML's handle of each GPU in ``ids`` (physical indices or UUIDs, as ``CUDA_VISIBLE_DEVICES`` names them)."""
    return [nvml.nvmlDeviceGetHandleByIndex(int(i)) if i.isdigit() else nvml.nvmlDeviceGetHandleByUUID(i) for i in ids]


def _gpu_memories(ids: list[str]) -> tuple[int, ...] | None:
    """Total memory of each GPU in ``ids`` through NVML; None without it or when NVML does not know one.

    Only these GPUs: NVML sees every GPU of the node, and a smaller board the job does not use says nothing of
    the job's budget."""
    return _nvml_query(lambda nvml: tuple(int(nvml.nvmlDeviceGetMemoryInfo(h).total) for h in _handles(nvml, ids)))


def _gpu_capabilities(ids: list[str]) -> tuple[tuple[int, int], ...] | None:
    """Compute capability of each GPU in ``ids`` (physical indices or UUIDs) through NVML; None without it.

    NVML numbers GPUs in PCI order, CUDA fastest first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: on a node of
    mixed GPUs an index may name another board, so each rank checks its own GPU again at start."""
    return _nvml_query(lambda nvml: tuple(tuple(nvml.nvmlDeviceGetCudaComputeCapability(h))
                                          for h in _handles(nvml, ids)))


def parse_gpus(spec: str, available: int) -> list[int]:
    """``--gpus`` -> visible GPU indices: "all", a count "N", or indices "0,2"."""
    text = spec.strip().lower()
    valid = f"valid: all, a count 1..{available}, or indices such as 0,1 (this machine sees {available} GPU(s))"
    if available == 0 and text != "all":
        raise DeviceError(
            f"--gpus {spec} asks for GPUs but this machine has no visible GPU; "
            "run on CPU ranks with --cpu --nproc-per-node N. Run `multigpu info` to see what torch finds."
        )
    if text == "all":
        return list(range(available))
    if "," not in text:
        if not text.isdigit():
            raise ConfigError(f"--gpus {spec} is not understood; {valid}")
        count = int(text)
        if count == 0:
            raise ConfigError("--gpus 0 is ambiguous: write --gpus 1 for one GPU, --gpus 0, for GPU 0, or --cpu")
        if not 1 <= count <= available:
            raise DeviceError(f"--gpus {spec} asks for {count} GPU(s) but this machine has {available}; {valid}")
        return list(range(count))
    parts = [p for p in text.split(",") if p != ""]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--gpus {spec} is not understood; {valid}")
    ids = [int(p) for p in parts]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"--gpus {spec} names GPU {dupes[0]} twice; {valid}")
    missing = [i for i in ids if i >= available]
    if missing:
        raise DeviceError(f"--gpus {spec} names GPU {missing[0]} but this machine has {available}; {valid}")
    return ids


def max_threads(cores: int) -> int:
    """The most compute threads a rank may be given: four per core, and at least 1,024 (past this many a thread
    pool runs nothing faster, and 100,000 failed to start at all: a rank "exited with code 130")."""
    return max(1024, 4 * cores)


def _threads_env(cfg: LaunchConfig, nproc: int, facts: HostFacts, inherited: dict[str, str]) -> dict[str, str]:
    if cfg.threads is not None:
        _check_threads(cfg.threads, f"--threads {cfg.threads}", facts)
        return {"OMP_NUM_THREADS": str(cfg.threads)}
    if "OMP_NUM_THREADS" in inherited:
        given = inherited["OMP_NUM_THREADS"].strip()
        if given.isdigit():
            _check_threads(int(given), f"OMP_NUM_THREADS={given}", facts)
        return {}
    return {"OMP_NUM_THREADS": str(max(1, facts.cores // nproc))}


def _check_threads(threads: int, given: str, facts: HostFacts) -> None:
    most = max_threads(facts.cores)
    if threads > most:
        raise ConfigError(f"{given} asks each rank for {threads:,} compute threads on {facts.cores} core(s); valid: "
                          f"at most {most:,} (the default, cores // ranks, is usually fastest), e.g. --threads "
                          f"{max(1, facts.cores)}")


def rank_mapped(facts: HostFacts, threads: str | None) -> int:
    """Address space a rank maps before it holds any data: what the launcher maps (torch imported; the fixed
    :data:`RANK_MAPPED_BYTES` where unknown) and :data:`THREAD_MAPPED_BYTES` for each further compute thread."""
    try:
        count = max(int(threads or 1), 1)
    except ValueError:
        count = 1
    return (facts.mapped_bytes or RANK_MAPPED_BYTES) + (count - 1) * THREAD_MAPPED_BYTES


def _check_fits(nproc: int, cpu_ranks: int, facts: HostFacts, threads: str | None) -> str | None:
    """Refuse more ranks than this node's memory holds, or an ``RLIMIT_AS`` that leaves a rank no room to start;
    a note when CPU ranks outnumber the cores."""
    mapped = rank_mapped(facts, threads)
    if facts.address_space_bytes is not None and facts.address_space_bytes < mapped:
        raise DeviceError(
            f"ulimit -v (RLIMIT_AS) is {format_bytes(facts.address_space_bytes)} per process, but a rank maps about "
            f"{format_bytes(mapped)} of address space before it holds any data (torch as this launcher maps it, "
            f"and {threads or 1} thread(s)); valid: ulimit -v unlimited (a cgroup or the scheduler's --mem caps real "
            f"memory), or more than {format_bytes(mapped)} plus what a rank's data needs")
    if facts.address_space_bytes is not None and facts.address_space_bytes < mapped + GLOO_GROUP_BYTES:
        need = mapped + GLOO_GROUP_BYTES
        raise DeviceError(
            f"ulimit -v (RLIMIT_AS) of {format_bytes(facts.address_space_bytes)} is too small for torch + gloo: a "
            f"rank maps about {format_bytes(mapped)} with torch loaded ({threads or 1} thread(s)) and "
            f"{format_bytes(GLOO_GROUP_BYTES)} more for its gloo process group and DDP's buffers, "
            f"{format_bytes(need)} before it holds any data (below that it dies in gloo or DDP); valid: ulimit -v "
            f"unlimited (a cgroup or the scheduler's --mem caps real memory), or raise it above "
            f"{format_bytes(need)} plus what a rank's data needs (ulimit -v {-(-need // 1024)} at the least)")
    if facts.available_bytes is not None and nproc * RANK_RESIDENT_BYTES > facts.available_bytes:
        fits = facts.available_bytes // RANK_RESIDENT_BYTES
        valid = f"--nproc-per-node at most {fits} on this machine" if fits else "free some memory first"
        raise DeviceError(
            f"--nproc-per-node {nproc}: {nproc:,} ranks need at least {format_bytes(nproc * RANK_RESIDENT_BYTES)} "
            f"(each torch process holds about {format_bytes(RANK_RESIDENT_BYTES)}) but there is "
            f"{format_bytes(facts.available_bytes)} of memory available {facts.memory_words}; valid: {valid}")
    if cpu_ranks > facts.cores:
        per = threads or "?"
        return (f"{cpu_ranks} CPU ranks on {facts.cores} core(s): {per} thread(s) per rank, so ranks share cores "
                f"and each runs slower than alone (--nproc-per-node {facts.cores} gives each rank a core)")
    return None


def _join(*notes: str | None) -> str | None:
    return "; ".join(n for n in notes if n) or None


def plan_devices(cfg: LaunchConfig, facts: HostFacts, inherited: dict[str, str] | None = None) -> DevicePlan:
    """Resolve the worker count and device variables for this node."""
    plan = _plan_devices(cfg, facts, inherited)
    _check_ranks_filter(cfg, plan.nproc_per_node)
    return plan


def _check_ranks_filter(cfg: LaunchConfig, nproc: int) -> None:
    """``--local-ranks-filter`` names only local ranks this node has (one beyond them hid every line silently)."""
    beyond = sorted(r for r in cfg.local_ranks_filter or () if r >= nproc)
    if beyond:
        raise ConfigError(f"--local-ranks-filter {','.join(map(str, cfg.local_ranks_filter))} names local rank(s) "
                          f"{', '.join(map(str, beyond))}, but this node runs {nproc} worker(s); valid: local ranks "
                          f"0 to {nproc - 1}")


def _plan_devices(cfg: LaunchConfig, facts: HostFacts, inherited: dict[str, str] | None = None) -> DevicePlan:
    inherited = dict(os.environ) if inherited is None else inherited
    note = None
    if cfg.cpu or facts.gpu_count == 0:
        if cfg.isolate_devices and not cfg.cpu:
            raise DeviceError("--isolate-devices pins each worker to a GPU, but this machine has no visible GPU")
        if cfg.gpus is not None and cfg.gpus.strip().lower() != "all":
            parse_gpus(cfg.gpus, facts.gpu_count)  # raises the no-GPU error
        nproc = 1 if cfg.nproc_per_node == "auto" else cfg.nproc_per_node
        if not cfg.cpu:
            note = f"no GPU visible: running {nproc} CPU rank(s) on gloo"
        env = {"CUDA_VISIBLE_DEVICES": ""} if cfg.cpu else {}
        env |= _threads_env(cfg, nproc, facts, inherited)
        env |= heap.rank_env(inherited)  # large blocks reused, not mapped and zeroed again each step
        threads = env.get("OMP_NUM_THREADS", inherited.get("OMP_NUM_THREADS"))
        note = _join(note, _check_fits(nproc, nproc, facts, threads))
        return DevicePlan(nproc, [], env, note, available_bytes=facts.available_bytes,
                          memory_source=facts.memory_source, address_space_bytes=facts.address_space_bytes,
                          rank_mapped_bytes=rank_mapped(facts, threads))

    selected = parse_gpus(cfg.gpus, facts.gpu_count) if cfg.gpus is not None else list(range(facts.gpu_count))
    if cfg.nproc_per_node == "auto":
        nproc = len(selected)
    else:
        nproc = cfg.nproc_per_node
        if cfg.gpus is None:
            selected = selected[:nproc]
        elif nproc < len(selected):
            raise ConfigError(
                f"--nproc-per-node {nproc} with --gpus {cfg.gpus} leaves GPUs unused; "
                f"valid: --nproc-per-node {len(selected)} (one per GPU), or fewer --gpus"
            )
    shared = nproc > len(selected) and not cfg.allow_cpu_ranks
    if shared and not cfg.share_gpus:
        raise DeviceError(
            f"--nproc-per-node {nproc} needs {nproc} GPUs but {len(selected)} are selected, and NCCL allows one "
            f"rank per GPU; valid: --nproc-per-node {len(selected)}, --allow-cpu-ranks (the extra ranks on the CPU), "
            "--cpu (every rank on the CPU), or --share-gpus (ranks share the GPUs, collectives over gloo)"
        )
    if shared:
        selected = [selected[i % len(selected)] for i in range(nproc)]  # round-robin: rank i on GPU i mod n
    ids = [facts.physical_ids()[i] for i in selected]
    env: dict[str, str] = {}
    isolated = cfg.isolate_devices or shared  # a shared GPU is each of its workers' cuda:0
    if isolated:
        env[envvars.DEVICE_MAP] = ",".join(ids)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    if shared:
        note = (f"{nproc} ranks share {len(set(ids))} GPU(s) round-robin (physical ids {','.join(ids)}), each worker "
                "pinned to its GPU; collectives over gloo (NCCL allows one rank per GPU)")
    hybrid = nproc > len(ids)
    if hybrid:
        note = f"hybrid job: {len(ids)} GPU rank(s) and {nproc - len(ids)} CPU rank(s) per node, gloo everywhere"
    env |= _threads_env(cfg, nproc, facts, inherited)
    threads = env.get("OMP_NUM_THREADS", inherited.get("OMP_NUM_THREADS"))
    note = _join(note, _check_fits(nproc, nproc - len(ids), facts, threads))
    caps, memories = facts.gpu_capabilities, facts.gpu_memories
    lowest = min(caps[i] for i in selected) if caps and len(caps) == facts.gpu_count else None
    smallest = (min(memories[i] for i in selected) if memories and len(memories) == facts.gpu_count
                else facts.gpu_memory_bytes)  # the selected GPUs', where each is known
    return DevicePlan(nproc, ids, env, note, isolated=isolated, hybrid=hybrid, shared=shared,
                      gpu_ranks=len(ids) if hybrid else None,
                      available_bytes=facts.available_bytes, gpu_memory_bytes=smallest,
                      memory_source=facts.memory_source, address_space_bytes=facts.address_space_bytes,
                      rank_mapped_bytes=rank_mapped(facts, threads), gpu_capability=lowest)


def configs_for(cfg: LaunchConfig, sizes: tuple[int, ...]) -> dict[int, LaunchConfig]:
    """The launch config of each world size of one node (``bench``, ``verify``, sim's ``--check-split``); with ``--gpus``, the first N of the chosen GPUs.

    Raises ConfigError/DeviceError for a size the selection cannot serve, before anything runs.
    """
    if cfg.gpus is None:
        return {n: replace(cfg, nproc_per_node=n) for n in sizes}
    chosen = parse_gpus(cfg.gpus, HostFacts.probe().gpu_count)
    out = {}
    for n in sizes:
        if n > len(chosen):
            raise ConfigError(f"--nproc {n} needs {n} GPUs but --gpus {cfg.gpus} selects "
                              f"{len(chosen)}; valid: --nproc up to {len(chosen)}")
        # "1," is GPU 1; a bare "1" would mean one GPU
        out[n] = replace(cfg, nproc_per_node=n, gpus=",".join(map(str, chosen[:n])) + ",")
    return out
