"""The facts ``multigpu doctor`` judges, gathered once (runs in the launcher).

:class:`Facts` is plain data; :func:`gather_facts` reads it from this machine.
The checks (:mod:`multigpu.doctor.checks`) are pure functions of it, so tests
feed them broken setups (mismatched device variables, no NCCL, a tiny
``/dev/shm``) without needing one.
"""

from __future__ import annotations

import os
import shutil
import socket
from dataclasses import dataclass, field
from typing import Any

from multigpu.launch import heap

__all__ = ["ENV_VARS", "Facts", "Interface", "free_port", "gather_facts"]

ENV_VARS = ("CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE", "EGL_DEVICE_ID",
            "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", *heap.USER_VARS)
"""The variables the checks read (only the ones that are set are kept)."""


@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    ipv4: tuple[str, ...] = ()


@dataclass(frozen=True)
class Facts:
    """Everything the checks need; the defaults describe a healthy CPU-only machine."""

    torch_version: str = "2.13.0"
    cuda_build: str | None = None
    """torch.version.cuda: the CUDA the wheel was built for; None for CPU/ROCm builds."""
    hip_build: str | None = None
    gpus: tuple[str, ...] = ()
    """Model name of each GPU torch sees."""
    nvml_installed: bool = False
    """nvidia-ml-py importable."""
    nvml_driver: str | None = None
    """Driver version NVML reports; None when NVML is missing or failed."""
    nvml_gpus: tuple[str, ...] = ()
    """Model name of each GPU NVML sees (all of the node's, whatever CUDA_VISIBLE_DEVICES says)."""
    nvml_error: str | None = None
    nccl_available: bool = False
    nccl_version: str | None = None
    gloo_available: bool = True
    env: dict[str, str] = field(default_factory=dict)
    """The variables of :data:`ENV_VARS` that are set, and every ``MALLOC_*`` one (glibc's heap variables, or a
    near miss of one)."""
    glibc: str | None = "2.36"
    """glibc's version (Linux); None where the C library is another."""
    malloc_tunables: dict[str, list[int]] | None = None
    """glibc's malloc tunables as its loader takes them from this environment, ``{name: [value, min, max]}``
    (:func:`multigpu.launch.heap.malloc_tunables`); None where no heap variable is set or the loader cannot say."""
    shm_bytes: int | None = 8 * 2**30
    """Size of /dev/shm; None when there is none."""
    nofile: tuple[int, int] | None = (65536, 65536)
    """Open-file limit (soft, hard); None where the platform has none."""
    free_port: int | None = 40000
    port_error: str | None = None
    interfaces: tuple[Interface, ...] = (Interface("lo", True, ("127.0.0.1",)),)
    bandwidth: dict[str, Any] | None = None
    """All-reduce result: world_size, backend, size_bytes, seconds, algbw_gbps, busbw_gbps."""
    bandwidth_error: str | None = None
    bandwidth_skipped: bool = False
    device_memory_bytes: int | None = None
    """Memory of the smallest GPU torch sees, or of the host when there is none; None when unknown."""
    p2p: tuple[tuple[int, int, bool], ...] = ()
    """(i, j, can access) for each pair of visible GPUs (torch.cuda.can_device_access_peer); () with < 2 GPUs."""
    nvlink: tuple[int, ...] = ()
    """Active NVLink links of each GPU NVML sees (NVML order); () without NVML or GPUs."""
    infiniband: tuple[tuple[str, str], ...] = ()
    """(device, state of its first port) of each InfiniBand/RoCE adapter in /sys/class/infiniband."""
    gpudirect_rdma: bool = False
    """The nvidia_peermem (or nv_peer_mem) kernel module is loaded: NICs read and write GPU memory directly."""


def free_port() -> tuple[int | None, str | None]:
    """Bind port 0 on localhost, as the c10d rendezvous does: (port, None) or (None, why not)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1], None
    except OSError as exc:
        return None, str(exc)


def _nvml() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {"nvml_installed": False}
    out: dict[str, Any] = {"nvml_installed": True}
    try:
        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            names, links = [], []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                names.append(name.decode() if isinstance(name, bytes) else name)
                links.append(nvlink_count(pynvml, handle))
        finally:
            pynvml.nvmlShutdown()
        out.update(nvml_driver=driver.decode() if isinstance(driver, bytes) else driver, nvml_gpus=tuple(names),
                   nvlink=tuple(links))
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        out["nvml_error"] = str(exc) or type(exc).__name__
    return out


def nvlink_count(nvml: Any, handle: Any) -> int:
    """Active NVLink links of one GPU (0 where it has none, or NVML cannot say)."""
    active = 0
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            active += nvml.nvmlDeviceGetNvLinkState(handle, link) == getattr(nvml, "NVML_FEATURE_ENABLED", 1)
        except Exception:  # noqa: BLE001 - NotSupported (no NVLink) or InvalidArgument (past its last link)
            break
    return active


def _p2p(gpu_count: int) -> tuple[tuple[int, int, bool], ...]:
    import torch

    try:
        return tuple((i, j, bool(torch.cuda.can_device_access_peer(i, j)))
                     for i in range(gpu_count) for j in range(gpu_count) if i < j)
    except Exception:  # noqa: BLE001 - the check then says nothing about P2P
        return ()


def _infiniband(root: str = "/sys/class/infiniband") -> tuple[tuple[str, str], ...]:
    """(device, "ACTIVE"/"DOWN"/...) of each adapter, from sysfs (its first port's state file reads "4: ACTIVE")."""
    from pathlib import Path

    out = []
    for dev in sorted(Path(root).glob("*")):
        states = sorted(dev.glob("ports/*/state"))
        try:
            state = states[0].read_text().split(":")[-1].strip() if states else "unknown"
        except OSError:
            state = "unknown"
        out.append((dev.name, state))
    return tuple(out)


def _gpudirect_rdma() -> bool:
    return any(os.path.isdir(f"/sys/module/{m}") for m in ("nvidia_peermem", "nv_peer_mem"))


def _interfaces() -> tuple[Interface, ...]:
    import psutil

    stats = psutil.net_if_stats()
    addrs = psutil.net_if_addrs()
    return tuple(
        Interface(name, bool(stats[name].isup) if name in stats else False,
                  tuple(a.address for a in addrs.get(name, []) if a.family == socket.AF_INET))
        for name in sorted(set(stats) | set(addrs))
    )


def _nofile() -> tuple[int, int] | None:
    try:
        import resource
    except ImportError:  # Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    big = 2**31  # RLIM_INFINITY shows as -1 or a huge number
    return (soft if soft >= 0 else big, hard if hard >= 0 else big)


def _device_memory(gpu_count: int) -> int | None:
    import torch

    try:
        if gpu_count:
            return min(torch.cuda.get_device_properties(i).total_memory for i in range(gpu_count))
        import psutil

        from multigpu.launch.memlimit import cgroup_memory

        limit = cgroup_memory()  # a container's or a batch job's cap, not the host's memory
        return min(int(psutil.virtual_memory().total), limit.limit_bytes if limit else 1 << 62)
    except Exception:  # noqa: BLE001 - the check says the figure is unknown
        return None


def _heap_vars_set() -> bool:
    return "GLIBC_TUNABLES" in os.environ or any(k.startswith("MALLOC_") for k in os.environ)


def gather_facts(*, bandwidth: bool = True) -> Facts:
    """Read every fact from this machine; ``bandwidth`` runs the short all-reduce test (seconds)."""
    import torch
    import torch.distributed as dist

    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) \
        if torch.cuda.is_available() else ()
    nccl_version = None
    if dist.is_nccl_available() and torch.version.cuda:
        try:
            nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            nccl_version = None
    try:
        shm = shutil.disk_usage("/dev/shm").total
    except OSError:
        shm = None
    port, port_error = free_port()
    facts = dict(
        torch_version=torch.__version__.split("+")[0],
        cuda_build=torch.version.cuda,
        hip_build=getattr(torch.version, "hip", None),
        gpus=gpus,
        nccl_available=dist.is_nccl_available(),
        nccl_version=nccl_version,
        gloo_available=dist.is_gloo_available(),
        env={k: v for k, v in os.environ.items() if k in ENV_VARS or k.startswith("MALLOC_")},
        glibc=heap.glibc_version(),
        malloc_tunables=heap.malloc_tunables(os.environ) if _heap_vars_set() else None,
        shm_bytes=shm,
        nofile=_nofile(),
        free_port=port,
        port_error=port_error,
        interfaces=_interfaces(),
        device_memory_bytes=_device_memory(len(gpus)),
        p2p=_p2p(len(gpus)) if len(gpus) > 1 else (),
        infiniband=_infiniband(),
        gpudirect_rdma=_gpudirect_rdma(),
        **_nvml(),
    )
    if bandwidth:
        from multigpu.doctor.bandwidth import measure

        try:
            facts["bandwidth"] = measure(gpus=len(gpus) if facts["nccl_available"] else 0)
        except Exception as exc:  # noqa: BLE001 - the check reports it with a hint
            facts["bandwidth_error"] = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    else:
        facts["bandwidth_skipped"] = True
    return Facts(**facts)
