"""Device sampler: a background thread on each node's local rank 0 (inside the ranks).

Every ``interval_s`` seconds (default 1 s, the launcher's ``--sample-interval-s``; 0 = off)
it appends one JSON line to ``<run_dir>/samples_node<k>.jsonl``::

    {"time": 1795000000.1, "node_rank": 0, "host": "gpu-box",
     "cpu_percent": 87.5, "memory_used_gib": 9.1, "memory_total_gib": 24.0,
     "ranks": [{"rank": 0, "local_rank": 0, "pid": 4242, "cpu_percent": 99.0, "rss_gib": 0.41}, ...],
     "gpus": [{"index": 0, "name": "NVIDIA H100", "util_percent": 97, "memory_used_gib": 61.2,
               "memory_total_gib": 79.6, "power_w": 612.3, "temperature_c": 71,
               "uuid": "GPU-5f3c...", "ranks": [0]}, ...]}

* Which GPU is which rank's: NVML numbers GPUs in PCI order and ignores
  ``CUDA_VISIBLE_DEVICES``, so its index says nothing about a rank. Each CUDA rank
  records its device's UUID (``torch.cuda.get_device_properties(i).uuid``, which
  torch reads through ``CUDA_VISIBLE_DEVICES``) in its rank file, and the sampler
  samples exactly those GPUs, by UUID (``nvmlDeviceGetHandleByUUID``), each with
  the ranks on it and NVML's own index. Until a rank has said (or on CPU ranks)
  it samples every GPU NVML sees, without ``uuid``/``ranks``.

* GPUs through NVML (``nvidia-ml-py``, extra ``gpu``), imported only when the
  sampler starts; without NVIDIA GPUs ``gpus`` is an empty list.
* CPU and memory of every rank on this node through psutil: each rank drops a
  small file naming its pid into ``<run_dir>/ranks/`` (:func:`register_rank`),
  and the sampler follows those pids. No collective, nothing in the step loop.

``StepMeter.from_context`` starts it when the run has a directory (:func:`start_for_rank`);
a workload can also run one itself::

    with Sampler(run_dir, interval_s=0.5):
        ...
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from multigpu.errors import OutputError
from multigpu.files import JsonlLog, write_text_atomic

__all__ = ["Sampler", "gpu_samples", "rank_gpu_uuid", "register_rank", "start_for_rank"]

_GIB = 2**30


def _placement() -> tuple[int, int, int]:
    """(rank, local_rank, node_rank) of this process, with or without ``mg.init``."""
    from multigpu.runtime import group

    return group.rank(), group.local_rank(), group.node_rank()


def rank_gpu_uuid() -> str | None:
    """This rank's GPU as NVML names it (``GPU-<uuid>``), from torch, which honours ``CUDA_VISIBLE_DEVICES``;
    None on a rank that does not compute on CUDA."""
    from multigpu.runtime import group

    device = group.current_device()
    if device.type != "cuda":
        return None
    import torch

    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - monitoring never takes the job down: this rank's GPU goes unnamed
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def register_rank(run_dir: str | Path) -> Path:
    """Write ``<run_dir>/ranks/rank<r>.json`` (pid, host, local rank, GPU UUID) so the node's sampler follows this
    rank and samples its GPU."""
    rank, local_rank, node_rank = _placement()
    info = {"rank": rank, "local_rank": local_rank, "node_rank": node_rank, "pid": os.getpid(),
            "host": socket.gethostname(), "gpu_uuid": rank_gpu_uuid()}
    return write_text_atomic(Path(run_dir) / "ranks" / f"rank{rank}.json", json.dumps(info))


def gpu_samples(nvml: Any, handles: list[Any], ranks: list[list[int]] | None = None) -> list[dict[str, Any]]:
    """One sample per GPU from an NVML module (``pynvml``) and its device handles.

    A figure a GPU does not report (power on some boards) is ``None``. ``ranks``: the ranks on each handle's
    GPU; given, each sample also has NVML's index, the GPU's ``uuid`` and its ``ranks``.
    """
    out = []
    for index, handle in enumerate(handles):
        def read(fn, *args, _h=handle):
            try:
                return fn(_h, *args)
            except Exception:  # noqa: BLE001 - NVML raises NVMLError_NotSupported and kin per figure
                return None

        util = read(nvml.nvmlDeviceGetUtilizationRates)
        mem = read(nvml.nvmlDeviceGetMemoryInfo)
        power = read(nvml.nvmlDeviceGetPowerUsage)  # milliwatts
        name = read(nvml.nvmlDeviceGetName)
        if ranks is not None:
            nvml_index = read(nvml.nvmlDeviceGetIndex)
            index = nvml_index if nvml_index is not None else index
        out.append({
            "index": index,
            "name": name.decode() if isinstance(name, bytes) else name,
            "util_percent": util.gpu if util is not None else None,
            "memory_used_gib": mem.used / _GIB if mem is not None else None,
            "memory_total_gib": mem.total / _GIB if mem is not None else None,
            "power_w": power / 1000 if power is not None else None,
            "temperature_c": read(nvml.nvmlDeviceGetTemperature, nvml.NVML_TEMPERATURE_GPU),
        })
        if ranks is not None:
            uuid = read(nvml.nvmlDeviceGetUUID)
            out[-1].update(uuid=uuid.decode() if isinstance(uuid, bytes) else uuid, ranks=ranks[len(out) - 1])
    return out


def _open_nvml() -> tuple[Any, list[Any]] | None:
    """(pynvml, handles) when NVIDIA GPUs and NVML are there; None otherwise (said once if it matters)."""
    try:
        import pynvml
    except ImportError:
        import torch

        if torch.cuda.is_available() and torch.version.cuda:
            print("multigpu: GPU figures need NVML: pip install 'multigpu[gpu]' (nvidia-ml-py)", file=sys.stderr)
        return None
    try:
        pynvml.nvmlInit()
        return pynvml, [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound / DriverNotLoaded: no NVIDIA GPU here
        return None


class Sampler:
    """Samples this node's devices, host and ranks into ``samples_node<k>.jsonl`` from a daemon thread.

    Args:
        run_dir: The run directory (the file goes there).
        interval_s: Seconds between samples.
        node_rank: Names the file; default: this process's node.
        gpus: Sample GPUs through NVML when available (False: never import it).
    """

    def __init__(self, run_dir: str | Path, interval_s: float = 1.0, *, node_rank: int | None = None,
                 gpus: bool = True):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.run_dir = Path(run_dir)
        self.interval_s = interval_s
        self.node_rank = _placement()[2] if node_rank is None else node_rank
        self.path = self.run_dir / f"samples_node{self.node_rank}.jsonl"
        self._log = JsonlLog(self.path, "device samples")
        self.host = socket.gethostname()
        self._want_gpus = gpus
        self._nvml: tuple[Any, list[Any]] | None = None
        self._procs: dict[int, tuple[dict, Any]] = {}  # pid -> (rank info, psutil.Process)
        self._uuid_handles: dict[str, Any] = {}  # GPU UUID -> NVML handle (None: NVML does not know it)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Sampler:
        """Take a first sample and start the thread. Returns self."""
        import psutil

        psutil.cpu_percent(None)  # the first call only sets the reference point
        if self._want_gpus:
            self._nvml = _open_nvml()
        self._write(self.sample(first=True))
        self._thread = threading.Thread(target=self._loop, name="multigpu-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread and take a last sample (so even a short run has a start and an end)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        self._thread = None
        self._write(self.sample())
        if self._nvml is not None:
            try:
                self._nvml[0].nvmlShutdown()
            except Exception:  # noqa: BLE001
                pass
            self._nvml = None

    def __enter__(self) -> Sampler:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write(self.sample())
            except Exception as exc:  # noqa: BLE001 - monitoring must never take the job down
                print(f"multigpu: sampler stopped: {type(exc).__name__}: {exc}", file=sys.stderr)
                return

    def _write(self, record: dict[str, Any]) -> None:
        self._log.append(record)  # a whole line or none; a full disk is said once, sampling goes on

    def _follow_ranks(self) -> set[int]:
        """Pick up ranks of this node that registered since the last sample; returns their pids."""
        import psutil

        new = set()
        for path in sorted((self.run_dir / "ranks").glob("rank*.json")):
            try:
                info = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if info.get("host") != self.host or info.get("node_rank") != self.node_rank or info["pid"] in self._procs:
                continue
            try:
                proc = psutil.Process(info["pid"])
                proc.cpu_percent(None)  # reference point; the next sample reports the interval
            except psutil.Error:
                continue
            self._procs[info["pid"]] = (info, proc)
            new.add(info["pid"])
        return new

    def _rank_samples(self, new: set[int]) -> list[dict[str, Any]]:
        """CPU (percent of one core; None when just discovered) and resident memory of each rank."""
        import psutil

        out = []
        for pid, (info, proc) in sorted(self._procs.items(), key=lambda kv: kv[1][0]["rank"]):
            try:
                with proc.oneshot():
                    cpu, rss = proc.cpu_percent(None), proc.memory_info().rss
            except psutil.Error:
                del self._procs[pid]
                continue
            out.append({"rank": info["rank"], "local_rank": info["local_rank"], "pid": pid,
                        "cpu_percent": None if pid in new else cpu, "rss_gib": rss / _GIB})
        return out

    def sample(self, first: bool = False) -> dict[str, Any]:
        """One record: host CPU/memory, this node's ranks, and its GPUs.

        CPU figures are averages since the previous sample, so the ``first`` one has none (None).
        """
        import psutil

        new = self._follow_ranks()
        vm = psutil.virtual_memory()
        cpu = psutil.cpu_percent(None)
        return {
            "time": time.time(),
            "node_rank": self.node_rank,
            "host": self.host,
            "cpu_percent": None if first else cpu,
            "memory_used_gib": (vm.total - vm.available) / _GIB,
            "memory_total_gib": vm.total / _GIB,
            "ranks": self._rank_samples(new),
            "gpus": self._gpu_samples() if self._nvml else [],
        }

    def _gpu_samples(self) -> list[dict[str, Any]]:
        """The GPUs of this node's ranks, by UUID (NVML's order ignores CUDA_VISIBLE_DEVICES); every GPU NVML sees
        while no rank has named one."""
        nvml, every = self._nvml
        on: dict[str, list[int]] = {}
        for info, _ in self._procs.values():
            if info.get("gpu_uuid"):
                on.setdefault(info["gpu_uuid"], []).append(info["rank"])
        if not on:
            return gpu_samples(nvml, every)
        handles, ranks = [], []
        for uuid, on_it in sorted(on.items(), key=lambda kv: min(kv[1])):
            if uuid not in self._uuid_handles:
                try:
                    self._uuid_handles[uuid] = nvml.nvmlDeviceGetHandleByUUID(uuid)
                except Exception:  # noqa: BLE001 - a UUID NVML does not know (a MIG slice): not sampled
                    self._uuid_handles[uuid] = None
            if self._uuid_handles[uuid] is not None:
                handles.append(self._uuid_handles[uuid])
                ranks.append(sorted(on_it))
        return gpu_samples(nvml, handles, ranks)


def start_for_rank(run_dir: str | Path, interval_s: float = 1.0) -> Sampler | None:
    """Register this rank; on local rank 0 also start the node's sampler and return it. Call on every rank.

    ``interval_s``: seconds between records; 0 turns sampling off.
    """
    if interval_s <= 0:
        return None
    try:
        register_rank(run_dir)
    except OutputError as exc:  # a full or read-only disk: say so once, run without samples
        print(f"warning: {exc}; no device samples for this run (the run goes on)", file=sys.stderr, flush=True)
        return None
    if _placement()[1] != 0:
        return None
    return Sampler(run_dir, interval_s).start()
