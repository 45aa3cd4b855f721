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
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from multigpu import envvars
from multigpu.errors import ConfigError, DeviceError
from multigpu.launch._worker import DEVICE_VARIABLES
from multigpu.launch.config import LaunchConfig

__all__ = ["DEVICE_VARIABLES", "RANK_RESIDENT_BYTES", "DevicePlan", "HostFacts", "format_bytes", "parse_gpus",
           "plan_devices"]

RANK_RESIDENT_BYTES = 200 << 20
"""Memory a rank holds before it holds any data: a Python process with torch imported and a gloo group
(measured: 150-200 MiB of its own pages, USS, on CPU; a CUDA context adds more). A lower bound, so
the check below never refuses a job that would fit."""


def format_bytes(n: float) -> str:
    """``1.5 GiB``: binary units, three significant digits."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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
    """Memory of the smallest GPU of this node (NVML, when installed), for data that lives on the GPU."""
    gpu_capabilities: tuple[tuple[int, int], ...] | None = None
    """CUDA compute capability of each visible GPU, in visible order (NVML, when installed; None: unknown)."""

    @classmethod
    def probe(cls) -> HostFacts:
        """The real host (tests pass their own ``HostFacts`` instead, or replace this method)."""
        import psutil
        import torch

        from multigpu.runtime.env import cpu_count

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        from multigpu.launch.memlimit import effective_memory_limit

        vm = psutil.virtual_memory()
        capped = effective_memory_limit()  # a scheduler's cgroup may allow far less than the machine has free
        available = min(vm.available, capped.available) if capped else vm.available
        facts = cls(gpu_count=count, visible=os.environ.get("CUDA_VISIBLE_DEVICES"), cores=cpu_count(),
                    memory_bytes=min(vm.total, capped.limit) if capped else vm.total, available_bytes=available,
                    gpu_memory_bytes=_gpu_memory() if count else None)
        return replace(facts, gpu_capabilities=_gpu_capabilities(facts.physical_ids())) if count else facts

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

    available_bytes: int | None = None
    """Memory available on this node when the job was planned (None: unknown)."""
    gpu_memory_bytes: int | None = None
    """Memory of this node's smallest GPU (None: unknown, or no GPU)."""
    gpu_capability: tuple[int, int] | None = None
    """The lowest CUDA compute capability of the selected GPUs (NVML; None: unknown, or no GPU). The launcher
    decides bf16 support from it without creating a CUDA context."""

    @property
    def device_types(self) -> list[str]:
        """The device types this node's ranks compute on: ["cuda"], ["cpu"] or both (hybrid)."""
        return (["cuda"] if self.gpu_ids else []) + (["cpu"] if len(self.gpu_ids) < self.nproc_per_node else [])

    def memory_per_rank(self, device_type: str = "cpu") -> int | None:
        """Bytes one rank of this node may fill with data: host memory beyond a rank's own
        (``available / nproc - RANK_RESIDENT_BYTES``) for ``"cpu"``, the smallest GPU for ``"cuda"``."""
        if device_type == "cuda":
            return self.gpu_memory_bytes
        if self.available_bytes is None:
            return None
        return max(self.available_bytes // self.nproc_per_node - RANK_RESIDENT_BYTES, 0)


def _gpu_memory() -> int | None:
    """The smallest GPU's memory through NVML (``nvidia-ml-py``, optional); None without it.

    NVML, not torch: asking torch would create a CUDA context in the launcher."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            sizes = [pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                     for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no device: unknown, so not checked
        return None
    return min(sizes) if sizes else None


def _gpu_capabilities(ids: list[str]) -> tuple[tuple[int, int], ...] | None:
    """Compute capability of each GPU in ``ids`` (physical indices or UUIDs) through NVML; None without it.

    NVML, not torch: ``torch.cuda.get_device_capability`` would create a CUDA context in the launcher (on
    GPU 0, for the whole job). NVML numbers GPUs in PCI order, CUDA fastest first unless
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: on a node of mixed GPUs an index may name another board, so each
    rank checks its own GPU again at start."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(int(i)) if i.isdigit()
                       else pynvml.nvmlDeviceGetHandleByUUID(i) for i in ids]
            return tuple(tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)) for h in handles)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, an id NVML does not know: unknown, so each rank checks
        return None


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


def _threads_env(cfg: LaunchConfig, nproc: int, facts: HostFacts, inherited: dict[str, str]) -> dict[str, str]:
    if cfg.threads is not None:
        return {"OMP_NUM_THREADS": str(cfg.threads)}
    if "OMP_NUM_THREADS" in inherited:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, facts.cores // nproc))}


def _check_fits(nproc: int, cpu_ranks: int, facts: HostFacts, threads: str | None) -> str | None:
    """Refuse more ranks than this node's memory holds; a note when CPU ranks outnumber the cores."""
    if facts.available_bytes is not None and nproc * RANK_RESIDENT_BYTES > facts.available_bytes:
        fits = facts.available_bytes // RANK_RESIDENT_BYTES
        valid = f"--nproc-per-node at most {fits} on this machine" if fits else "free some memory first"
        raise DeviceError(
            f"--nproc-per-node {nproc}: {nproc:,} ranks need at least {format_bytes(nproc * RANK_RESIDENT_BYTES)} "
            f"(each torch process holds about {format_bytes(RANK_RESIDENT_BYTES)}) but this machine has "
            f"{format_bytes(facts.available_bytes)} of memory available; valid: {valid}")
    if cpu_ranks > facts.cores:
        per = threads or "?"
        return (f"{cpu_ranks} CPU ranks on {facts.cores} core(s): {per} thread(s) per rank, so ranks share cores "
                f"and each runs slower than alone (--nproc-per-node {facts.cores} gives each rank a core)")
    return None


def _join(*notes: str | None) -> str | None:
    return "; ".join(n for n in notes if n) or None


def plan_devices(cfg: LaunchConfig, facts: HostFacts, inherited: dict[str, str] | None = None) -> DevicePlan:
    """Resolve the worker count and device variables for this node."""
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
        threads = env.get("OMP_NUM_THREADS", inherited.get("OMP_NUM_THREADS"))
        note = _join(note, _check_fits(nproc, nproc, facts, threads))
        return DevicePlan(nproc, [], env, note, available_bytes=facts.available_bytes)

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
        env[envvars.GPU_RANKS] = str(len(ids))  # the worker wrapper hides every GPU from the ranks after these
        note = f"hybrid job: {len(ids)} GPU rank(s) and {nproc - len(ids)} CPU rank(s) per node, gloo everywhere"
    env |= _threads_env(cfg, nproc, facts, inherited)
    threads = env.get("OMP_NUM_THREADS", inherited.get("OMP_NUM_THREADS"))
    note = _join(note, _check_fits(nproc, nproc - len(ids), facts, threads))
    caps = facts.gpu_capabilities
    lowest = min(caps[i] for i in selected) if caps and len(caps) == facts.gpu_count else None
    return DevicePlan(nproc, ids, env, note, isolated=isolated, hybrid=hybrid, shared=shared,
                      available_bytes=facts.available_bytes, gpu_memory_bytes=facts.gpu_memory_bytes,
                      gpu_capability=lowest)
