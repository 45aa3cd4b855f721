"""The doctor's checks: pure functions of :class:`~multigpu.doctor.facts.Facts` (run in the launcher).

Each returns a :class:`CheckResult` with a status (``pass``, ``warn``,
``fail``), what was found, and for anything short of a pass, what to do.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from multigpu.doctor.facts import Facts
from multigpu.launch import heap

__all__ = ["CHECKS", "CheckResult", "run_checks"]

_GIB = 2**30
SHM_FAIL_BYTES = 256 * 2**20
"""Below this /dev/shm fails: NCCL's shared-memory transport and DataLoader workers run out (Docker's default is 64 MiB)."""
SHM_WARN_BYTES = 1 * _GIB
NOFILE_FAIL = 1024
NOFILE_WARN = 4096
MIN_TORCH = (2, 4)


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str
    """"pass", "warn" or "fail"."""
    detail: str
    hint: str = ""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_torch(f: Facts) -> CheckResult:
    build = f"CUDA {f.cuda_build}" if f.cuda_build else f"ROCm {f.hip_build}" if f.hip_build else "CPU-only"
    detail = f"torch {f.torch_version} ({build} build)"
    if _version_tuple(f.torch_version) < MIN_TORCH:
        return CheckResult("torch", "fail", detail, f"multigpu needs torch >= {'.'.join(map(str, MIN_TORCH))}: "
                                                    "pip install -U torch")
    return CheckResult("torch", "pass", detail)


def check_gpus(f: Facts) -> CheckResult:
    if not f.gpus:
        if f.nvml_gpus:
            why = ("torch is a CPU-only build: install a CUDA build of torch (https://pytorch.org/get-started)"
                   if not f.cuda_build and not f.hip_build else
                   "check CUDA_VISIBLE_DEVICES and that the driver supports this torch's CUDA "
                   f"({f.cuda_build}); run nvidia-smi")
            return CheckResult("GPUs", "fail", f"NVML sees {len(f.nvml_gpus)} GPU(s) but torch sees none", why)
        return CheckResult("GPUs", "warn", "no GPU visible: ranks run on the CPU (gloo)",
                           "fine for development; on a GPU machine check the driver with nvidia-smi")
    models = Counter(f.gpus)
    listing = ", ".join(f"{n}x {name}" for name, n in models.items())
    if len(models) > 1:
        return CheckResult("GPUs", "warn", f"mixed models: {listing}",
                           "the slowest GPU sets the pace of every collective; pick identical ones with --gpus")
    return CheckResult("GPUs", "pass", listing)


def check_driver(f: Facts) -> CheckResult:
    if f.nvml_driver is not None:
        detail = f"driver {f.nvml_driver}, NVML sees {len(f.nvml_gpus)} GPU(s)"
        if len(f.nvml_gpus) != len(f.gpus) and "CUDA_VISIBLE_DEVICES" not in f.env:
            return CheckResult("driver / NVML", "warn", f"{detail} but torch sees {len(f.gpus)}",
                               "a GPU may be in a bad state or unsupported by this torch build; run nvidia-smi")
        return CheckResult("driver / NVML", "pass", detail)
    cuda_gpus = bool(f.gpus) and f.cuda_build is not None
    if not f.nvml_installed:
        if cuda_gpus:
            return CheckResult("driver / NVML", "warn", "nvidia-ml-py is not installed: no GPU utilization figures",
                               "pip install 'multigpu[gpu]'")
        return CheckResult("driver / NVML", "pass", "no NVIDIA GPU: NVML not needed")
    if cuda_gpus:
        return CheckResult("driver / NVML", "warn", f"NVML failed: {f.nvml_error}",
                           "the monitor cannot read GPU figures; check the driver with nvidia-smi")
    return CheckResult("driver / NVML", "pass", f"no NVIDIA driver ({f.nvml_error}): not needed without NVIDIA GPUs")


def check_nccl(f: Facts) -> CheckResult:
    if f.gpus:
        if not f.nccl_available:
            return CheckResult("NCCL", "fail", f"NCCL is not available in this torch build, but {len(f.gpus)} GPU(s) are",
                               "GPU ranks need NCCL: install an official CUDA build of torch (Linux wheels include "
                               "it); meanwhile `--cpu` runs the job on gloo")
        return CheckResult("NCCL", "pass", f"NCCL {f.nccl_version or '(version unknown)'}")
    if f.nccl_available:
        return CheckResult("NCCL", "pass", f"NCCL {f.nccl_version or '(version unknown)'} (no GPU here to use it)")
    return CheckResult("NCCL", "pass", "not available (no GPU here: gloo is used)")


def check_gloo(f: Facts) -> CheckResult:
    if not f.gloo_available:
        return CheckResult("gloo", "fail", "gloo is not available in this torch build",
                           "CPU ranks and multigpu's monitored barriers need gloo: install an official torch wheel")
    return CheckResult("gloo", "pass", "available")


def check_device_vars(f: Facts) -> CheckResult:
    name = "visible-device variables"
    cvd = f.env.get("CUDA_VISIBLE_DEVICES")
    singles = {k: f.env[k] for k in ("QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE", "EGL_DEVICE_ID") if k in f.env}
    named = ({"CUDA_VISIBLE_DEVICES": cvd} if cvd is not None else {}) | singles
    shown = ", ".join(f"{k}={v!r}" for k, v in named.items())
    hint = ("set them to the same physical GPU (CUDA_VISIBLE_DEVICES, QD_VISIBLE_DEVICE, TI_VISIBLE_DEVICE, "
            "EGL_DEVICE_ID), or unset them and let `multigpu launch --isolate-devices` set all four per worker")
    if cvd is None and not singles:
        return CheckResult(name, "pass", "none set: every process sees every GPU")
    bad = _unreadable_device(cvd) if cvd is not None else None
    if bad is not None:
        entry, kept = bad
        sees = f"only {', '.join(kept)} {'is' if len(kept) == 1 else 'are'} visible" if kept else "no GPU is visible"
        hides = entry.startswith("-") and entry[1:].isdigit()  # -1: the usual way to hide the GPUs, on purpose
        return CheckResult(name, "warn" if hides else "fail", f"CUDA_VISIBLE_DEVICES={cvd!r}: {entry!r} is not a GPU index or UUID, and "
                           f"CUDA reads no further: {sees}; valid: GPU indices (0,1) or UUIDs (GPU-..., MIG-...)",
                           "list GPU indices (0,1) or UUIDs (GPU-..., MIG-..., as nvidia-smi -L prints them), or unset it")
    if len(set(singles.values())) > 1:
        return CheckResult(name, "fail", f"they name different GPUs: {shown}", hint)
    if cvd is not None and singles:
        ids = [x.strip() for x in cvd.split(",") if x.strip()]
        outside = {k: v for k, v in singles.items() if v not in ids}
        if outside:
            which = ", ".join(f"{k}={v!r}" for k, v in outside.items())
            return CheckResult(name, "fail", f"{which} names a GPU that CUDA_VISIBLE_DEVICES={cvd!r} hides", hint)
    if cvd is not None and not cvd.strip() and f.nvml_gpus:
        return CheckResult(name, "warn", f"CUDA_VISIBLE_DEVICES is empty: it hides all {len(f.nvml_gpus)} GPU(s)",
                           "unset it to use the GPUs, or keep it to force CPU ranks")
    return CheckResult(name, "pass", f"agree: {shown}")


def _unreadable_device(cvd: str) -> tuple[str, list[str]] | None:
    """The first entry of ``CUDA_VISIBLE_DEVICES`` that CUDA cannot read (it ignores it and every entry after it)
    and the entries before it; None when every entry is an index or a GPU/MIG UUID (or the list is empty)."""
    entries = [x.strip() for x in cvd.split(",")]
    if not cvd.strip():
        return None
    for i, entry in enumerate(entries):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            return entry, entries[:i]
    return None


def check_cpu_heap(f: Facts) -> CheckResult | list[CheckResult]:
    """What CPU ranks' heap will be: glibc's thresholds as the launcher sets them, the user's own, or nothing; or,
    where a heap setting is one glibc ignores or misreads without a word, one warning for each
    (:func:`multigpu.launch.heap.ignored_settings`)."""
    name = "CPU ranks' heap"
    if f.glibc is None:
        return CheckResult(name, "pass", "not glibc: the C library's own policy (multigpu sets nothing)")
    ignored = heap.ignored_settings(f.env, f.malloc_tunables)
    if ignored:
        hint = ("fix it or unset it: glibc reads these variables once, as a process starts, and says nothing of "
                "one it cannot use (`ld.so --list-tunables` shows what it took)")
        return [CheckResult(name, "warn", line, hint) for line in ignored]
    mine = heap.users_choice(f.env)
    if mine is not None:
        return CheckResult(name, "pass", f"yours, kept for CPU ranks: {mine}")
    return CheckResult(name, "pass", f"glibc {f.glibc}: CPU ranks keep blocks up to {heap.MMAP_THRESHOLD >> 20} MiB "
                       f"for reuse (multigpu sets MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_)",
                       "set either variable, or preload another allocator, to choose otherwise")


def check_shm(f: Facts) -> CheckResult:
    hint = ("NCCL and DataLoader workers exchange data through /dev/shm: run the container with "
            "--shm-size=8g (or --ipc=host), or remount it larger")
    if f.shm_bytes is None:
        return CheckResult("/dev/shm", "warn", "no /dev/shm here", hint)
    size = f"{f.shm_bytes / _GIB:.2f} GiB" if f.shm_bytes >= _GIB else f"{f.shm_bytes / 2**20:.0f} MiB"
    if f.shm_bytes < SHM_FAIL_BYTES:
        return CheckResult("/dev/shm", "fail", f"only {size}", hint)
    if f.shm_bytes < SHM_WARN_BYTES:
        return CheckResult("/dev/shm", "warn", f"{size}: small for several GPUs or DataLoader workers", hint)
    return CheckResult("/dev/shm", "pass", size)


def check_open_files(f: Facts) -> CheckResult:
    if f.nofile is None:
        return CheckResult("open-file limit", "pass", "no limit on this platform")
    soft, hard = f.nofile
    detail = f"soft {soft}, hard {hard}"
    hint = (f"raise it before launching: ulimit -n {min(hard, 65536)}"
            + ("" if hard >= 65536 else " (the hard limit too, in /etc/security/limits.conf)"))
    if soft < NOFILE_FAIL:
        return CheckResult("open-file limit", "fail", f"{detail}: too low for many ranks and DataLoader workers", hint)
    if soft < NOFILE_WARN:
        return CheckResult("open-file limit", "warn", f"{detail}: may run out with many DataLoader workers", hint)
    return CheckResult("open-file limit", "pass", detail)


def check_port(f: Facts) -> CheckResult:
    if f.free_port is None:
        return CheckResult("rendezvous port", "fail", f"could not bind a free TCP port on localhost: {f.port_error}",
                           "the c10d rendezvous needs one: check the firewall and net.ipv4.ip_local_port_range")
    return CheckResult("rendezvous port", "pass", f"bound localhost:0 -> port {f.free_port}")


def _matches(spec: str, names: list[str], nccl_syntax: bool) -> list[str]:
    """Interfaces selected by an NCCL_SOCKET_IFNAME-style spec (prefixes, ^exclude, =exact) or a GLOO list."""
    if not nccl_syntax:
        wanted = {s.strip() for s in spec.split(",") if s.strip()}
        return [n for n in names if n in wanted]
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    body = body[1:] if exact else body
    parts = [p.strip() for p in body.split(",") if p.strip()]
    hit = [n for n in names if any(n == p if exact else n.startswith(p) for p in parts)]
    return [n for n in names if n not in hit] if exclude else hit


def check_network(f: Facts) -> CheckResult:
    name = "network interfaces"
    up = [i for i in f.interfaces if i.up]
    outside = [i for i in up if i.name != "lo" and not all(a.startswith("127.") for a in i.ipv4) and i.ipv4]
    listing = ", ".join(f"{i.name} ({', '.join(i.ipv4)})" for i in outside) or "loopback only"
    for var, nccl_syntax in (("NCCL_SOCKET_IFNAME", True), ("GLOO_SOCKET_IFNAME", False)):
        spec = f.env.get(var)
        if spec is not None and not _matches(spec, [i.name for i in up], nccl_syntax):
            return CheckResult(name, "fail", f"{var}={spec!r} matches no interface that is up "
                                             f"(up: {', '.join(i.name for i in up) or 'none'})",
                               f"set {var} to one of: {', '.join(i.name for i in up)}, or unset it")
    chosen = {k: f.env[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if k in f.env}
    if chosen:
        return CheckResult(name, "pass", f"{listing}; " + ", ".join(f"{k}={v}" for k, v in chosen.items()))
    if not outside:
        return CheckResult(name, "warn", "loopback only: ranks can run on this machine, not across machines",
                           "for multi-node jobs the nodes need a network interface they share")
    example = outside[0].name
    hint = f"for multi-node jobs: export NCCL_SOCKET_IFNAME={example} GLOO_SOCKET_IFNAME={example}"
    if len(outside) > 1:
        return CheckResult(name, "warn", f"several interfaces: {listing}; NCCL and gloo may pick the wrong one",
                           hint + " (the one the other nodes reach)")
    return CheckResult(name, "pass", listing, hint)


NVLINK_MIN_GBPS = 40.0
"""busbw below this with NVLink on every GPU: NCCL is not using it (NVLink runs at hundreds of GB/s; PCIe at ~25)."""
P2P_MIN_GBPS = 8.0
"""busbw below this with PCIe peer-to-peer between every pair: slower than PCIe Gen3 x16."""
HOST_MIN_GBPS = 3.0
"""busbw below this without P2P (through host shared memory): the speed of NCCL's socket fallback."""


def bandwidth_floor(f: Facts) -> tuple[float, str]:
    """The busbw a healthy NCCL all-reduce on this node's topology reaches at least, and the path it names."""
    if f.nvlink and len(f.nvlink) >= 2 and all(n > 0 for n in f.nvlink):
        return NVLINK_MIN_GBPS, "NVLink"
    if f.p2p and all(ok for _, _, ok in f.p2p):
        return P2P_MIN_GBPS, "PCIe peer-to-peer"
    return HOST_MIN_GBPS, "host shared memory (no P2P)"


def check_bandwidth(f: Facts) -> CheckResult:
    name = "all-reduce bandwidth"
    if f.bandwidth_skipped:
        return CheckResult(name, "warn", "skipped (--skip-bandwidth)", "run `multigpu doctor` without --skip-bandwidth")
    if f.bandwidth is None:
        return CheckResult(name, "fail", f"the test job failed: {f.bandwidth_error}",
                           "ranks could not start or talk to each other; try `multigpu launch --nproc-per-node 2 "
                           "examples/hello.py` and read its error")
    b = f.bandwidth
    detail = (f"busbw {b['busbw_gbps']:.2f} GB/s (algbw {b['algbw_gbps']:.2f} GB/s), "
              f"{b['size_bytes'] / 2**20:.0f} MiB on {b['world_size']} ranks ({b['backend']})")
    if b["backend"] == "nccl":
        floor, path = bandwidth_floor(f)
        if b["busbw_gbps"] < floor:
            return CheckResult(name, "warn", f"{detail}: below {floor:g} GB/s, slow for {path}",
                               "NCCL may be going through sockets or host memory: check NCCL_P2P_DISABLE, "
                               "NCCL_SHM_DISABLE, NCCL_P2P_LEVEL and run with NCCL_DEBUG=INFO (its 'via' lines)")
        return CheckResult(name, "pass", f"{detail}; at least {floor:g} GB/s expected over {path}")
    return CheckResult(name, "pass", detail)


def check_p2p(f: Facts) -> CheckResult | None:
    """GPU peer-to-peer access between every pair (NVLink or PCIe); no line with fewer than two GPUs."""
    if not f.p2p:
        return None
    missing = [f"{i}<->{j}" for i, j, ok in f.p2p if not ok]
    if missing:
        return CheckResult("GPU peer-to-peer", "warn", f"no P2P between GPU(s) {', '.join(missing)}",
                           "NCCL stages those transfers through host memory (slower): check the PCIe topology "
                           "with `nvidia-smi topo -m`, and IOMMU/ACS settings on bare metal")
    return CheckResult("GPU peer-to-peer", "pass", f"every pair of the {len(f.gpus)} GPUs ({len(f.p2p)} pairs)")


def check_nvlink(f: Facts) -> CheckResult | None:
    """Active NVLink links per GPU, where any GPU has NVLink."""
    if not any(f.nvlink):
        return None
    listing = ", ".join(f"GPU {i}: {n}" for i, n in enumerate(f.nvlink))
    down = [str(i) for i, n in enumerate(f.nvlink) if n == 0]
    if down:
        return CheckResult("NVLink", "warn", f"active links {listing}: GPU(s) {', '.join(down)} have none",
                           "a GPU without active NVLink falls back to PCIe and slows every collective: "
                           "`nvidia-smi nvlink -s`, and check the fabric manager on NVSwitch systems")
    return CheckResult("NVLink", "pass", f"active links {listing}")


def check_infiniband(f: Facts) -> CheckResult | None:
    """InfiniBand/RoCE adapters and GPUDirect RDMA, where an adapter is found."""
    if not f.infiniband:
        return None
    listing = ", ".join(f"{d} {s}" for d, s in f.infiniband)
    rdma = "GPUDirect RDMA on (nvidia_peermem loaded)" if f.gpudirect_rdma else "GPUDirect RDMA off"
    if not any(s == "ACTIVE" for _, s in f.infiniband):
        return CheckResult("InfiniBand / GPUDirect", "warn", f"{listing}: no adapter is ACTIVE; {rdma}",
                           "NCCL falls back to sockets between nodes: check the links with ibstat")
    if f.gpus and not f.gpudirect_rdma:
        return CheckResult("InfiniBand / GPUDirect", "warn", f"{listing}; {rdma}",
                           "between nodes every GPU transfer is staged through host memory: "
                           "`modprobe nvidia_peermem` (or use DMA-BUF with a recent driver and NCCL)")
    return CheckResult("InfiniBand / GPUDirect", "pass", f"{listing}; {rdma}")


TRAINING_BYTES_PER_PARAM = 16
"""fp32 weights, gradients and Adam's two moments: what data parallelism keeps on every rank, per parameter."""


def check_training_memory(f: Facts) -> CheckResult:
    """The largest model whose data-parallel training state fits one device; beyond it FSDP is needed."""
    name = "training memory"
    if not f.device_memory_bytes:
        return CheckResult(name, "pass", "device memory unknown")
    gib = f"{f.device_memory_bytes / 2**30:.0f} GiB"
    where = f"one {f.gpus[0]} ({gib})" if f.gpus else f"this host ({gib}, shared by its CPU ranks)"
    largest = f.device_memory_bytes / TRAINING_BYTES_PER_PARAM
    return CheckResult(name, "pass", f"data-parallel training fits models up to ~{largest / 1e9:.2g}B parameters on "
                       f"{where}: {TRAINING_BYTES_PER_PARAM} bytes per parameter (fp32 weights, gradients, Adam), "
                       "before activations",
                       "a larger model needs `multigpu train --strategy fsdp`, which shards that state over the "
                       "ranks (1/N each)")


CHECKS: list[Callable[[Facts], CheckResult | list[CheckResult] | None]] = [
    check_torch, check_gpus, check_driver, check_nccl, check_gloo, check_device_vars, check_cpu_heap,
    check_shm, check_open_files, check_port, check_network, check_p2p, check_nvlink, check_infiniband,
    check_bandwidth, check_training_memory,
]


def run_checks(facts: Facts) -> list[CheckResult]:
    """Every check on the same facts, in order; a check with nothing to look at here (no NVLink) gives no line."""
    results = []
    for check in CHECKS:
        found = check(facts)
        results += found if isinstance(found, list) else [found] if found is not None else []
    return results
