"""A job as it was measured: a ``multigpu bench`` folder (``bench.json``) or a run folder (``summary.json``),
carried to other GPUs (in the launcher).

    job = MeasuredJob.load("runs/bench/20261129-0710", measured_on=None)   # the device from bench.json's host
    step = job.step(cluster, catalog)      # compute by the roofline, collectives by bench.predict's model

*Compute*: ``multigpu bench --predict``'s fit of the measured runs (:func:`multigpu.bench.predict.predict`, fitted
on every measured size: compute per step ``a + b x`` over the items one rank handles, load imbalance as measured)
at the target's size, then carried from the measured device to the target GPU by a roofline: the share of the
compute that was FLOP-bound (known where the run counted its FLOPs: training's ``flops_per_token``) scales with
the ratio of the two devices' matmul rates, the rest with the ratio of their memory bandwidths. Where the FLOPs
are unknown (sim, infer, rl, a script), the step lies between the two ratios: the prediction is their geometric
mean and its interval spans both. The measured device's rates: a catalog GPU's peak at
:data:`multigpu.plan.model.MATMUL_EFFICIENCY` and its bandwidth at :data:`BANDWIDTH_EFFICIENCY`; this host's CPU,
measured here (a matmul and a copy at the ranks' thread count).

*Communication*: the job's own collectives as the step meter counted them (``traffic``), priced on the target's
links by the same alpha-beta model, hidden behind compute as the workload overlaps it (:data:`OVERLAP`).

*Memory*: a training run's peak per rank (``peak_memory_bytes``); under FSDP the training state's share moves to
1/N at N ranks. On CPU ranks the peak is the process's resident memory, less what ``import torch`` holds in this
process (the libraries a GPU rank keeps in host memory instead). Other workloads record no per-rank peak: their
fit is "not measured".
"""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError
from multigpu.plan.model import OVERLAP
from multigpu.plan.transformer import STATE_BYTES

__all__ = ["MeasuredJob", "cpu_roofline"]


def _rates_at(threads: int, n: int = 768) -> tuple[float, float]:
    """One try: a float32 matmul's FLOP/s and a copy's bytes/s with ``threads`` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        t0 = time.perf_counter()
        for _ in range(3):
            torch.mm(a, b)
        flops = 3 * 2 * n**3 / (time.perf_counter() - t0)
        src = torch.empty(16 * 2**20 // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src)
        return flops, 4 * 2 * src.numel() * 4 / (time.perf_counter() - t0)  # read and write
    finally:
        torch.set_num_threads(before)


def cpu_roofline(*threads: int, tries: int = 5) -> dict[int, dict[str, float]]:
    """This host's CPU as one rank sees it at each of ``threads`` threads: a float32 matmul's FLOP/s and a copy's
    bytes/s, the thread counts measured in turn (so a load that comes and goes weighs on each alike), the median
    of ``tries``."""
    seen: dict[int, list[tuple[float, float]]] = {t: [] for t in threads}
    for _ in range(tries):
        for t in threads:
            seen[t].append(_rates_at(t))
    return {t: {"flops": statistics.median(f for f, _ in v), "bandwidth": statistics.median(b for _, b in v)}
            for t, v in seen.items()}


def _torch_rss() -> int:
    """Resident bytes of this process (which has imported torch): what a CPU rank holds that a GPU rank's device
    memory does not."""
    import resource

    import torch  # noqa: F401 - imported for its resident size

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


@dataclass
class MeasuredJob:
    """What was measured, ready to be carried to other clusters."""

    path: Path
    runs: list[dict[str, Any]]
    unit: str
    device: str
    """A catalog GPU type, or "cpu" (this host's CPU)."""
    host: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _rates: dict[str, float] | None = None

    @classmethod
    def load(cls, folder: str | Path, measured_on: str | None = None, catalog=None) -> MeasuredJob:
        from multigpu.plan.catalog import load_catalog

        catalog = catalog or load_catalog()
        root = Path(folder)
        bench, summary = root / "bench.json", root / "summary.json"
        try:
            if bench.is_file():
                data = json.loads(bench.read_text())
                runs = [{**r, "world_size": int(r["world_size"])} for r in data["runs"]]
                host, unit = data.get("host") or {}, data.get("unit", "items")
            elif summary.is_file():
                s = json.loads(summary.read_text())
                runs, host, unit = [{"world_size": int(s["world_size"]), "summary": s}], {}, s.get("unit", "items")
            else:
                raise ConfigError(f"plan: {folder} holds neither bench.json nor summary.json; valid: a folder written "
                                  "by `multigpu bench` or by a workload run, or `train` with a model description")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"plan: {folder} is not a readable bench or run folder ({type(exc).__name__}: {exc})") from None
        if any(r["summary"].get("measure") == "wall" for r in runs):
            raise ConfigError(f"plan: {folder} was timed by its wall clock (a script without a StepMeter): its steps "
                              "are not known; valid: a script that measures its steps with multigpu.monitor.StepMeter")
        if measured_on is None:
            gpus = host.get("gpus")
            if gpus == []:
                measured_on = "cpu"
            elif gpus:
                gpu = catalog.gpu_for_board(str(gpus[0]))
                if gpu is None:
                    raise ConfigError(f"plan: {folder} was measured on {gpus[0]!r}, which the catalog does not list; "
                                      f"valid: --measured-on one of cpu, {', '.join(catalog.gpus)}")
                measured_on = gpu.key
            else:
                raise ConfigError(f"plan: {folder} does not say which device it ran on; valid: --measured-on cpu or "
                                  f"one of {', '.join(catalog.gpus)}")
        elif measured_on != "cpu":
            measured_on = catalog.gpu(measured_on).key
        if measured_on == "cpu" and host.get("hostname") not in (None, socket.gethostname()):
            raise ConfigError(f"plan: {folder} ran on the CPUs of {host['hostname']!r}, not this host's: their "
                              "matmul rate and memory bandwidth are measured here, so run `multigpu plan` there")
        if bench.is_file():
            host = {**host, "command": data.get("command") or []}
        return cls(root, runs, str(unit), measured_on, host)

    # ------------------------------------------------------------------ what was measured
    @property
    def last(self) -> dict[str, Any]:
        return max(self.runs, key=lambda r: r["world_size"])["summary"]

    @property
    def strategy(self) -> str | None:
        return self.last.get("strategy")

    @property
    def flops_per_item(self) -> float | None:
        """Training's model FLOPs per token (6N + 12LHT); None for other workloads."""
        value = self.last.get("flops_per_token")
        return float(value) if value and self.unit == "tokens" else None

    def threads(self) -> int:
        """Threads per rank in the measured runs: bench's ``--threads N`` where given, else its budget at the
        largest size (the cores over the ranks)."""
        command = list(self.host.get("command") or [])
        if "--threads" in command[:-1]:
            return int(command[command.index("--threads") + 1])
        cores = int(self.host.get("cores") or 1)
        return max(1, cores // max(r["world_size"] for r in self.runs))

    def rates(self, catalog) -> dict[str, float]:
        """The measured device's effective matmul FLOP/s and memory bytes/s."""
        from multigpu.plan.model import BANDWIDTH_EFFICIENCY, MATMUL_EFFICIENCY

        if self._rates is None:
            if self.device == "cpu":
                self._rates = cpu_roofline(self.threads())[self.threads()]
            else:
                gpu = catalog.gpu(self.device)
                precision = self.last.get("precision") or "bf16"
                peak = gpu.peak(precision if precision in gpu.tflops else "bf16")
                self._rates = {"flops": peak * MATMUL_EFFICIENCY, "bandwidth": gpu.bandwidth * BANDWIDTH_EFFICIENCY}
        return self._rates

    def scale(self, gpu, precision: str, compute_s: float, items: float, catalog) -> tuple[float, float, float, str]:
        """``(point, low, high, how)``: the factor from the measured device's compute to ``gpu``'s."""
        from multigpu.plan.model import BANDWIDTH_EFFICIENCY, MATMUL_EFFICIENCY

        rates = self.rates(catalog)
        by_flops = rates["flops"] / (gpu.peak(precision) * MATMUL_EFFICIENCY)
        by_bytes = rates["bandwidth"] / (gpu.bandwidth * BANDWIDTH_EFFICIENCY)
        per = self.flops_per_item
        if per and compute_s > 0:
            share = min(1.0, per * items / rates["flops"] / compute_s)
            point = share * by_flops + (1 - share) * by_bytes
            how = (f"{share:.0%} of the measured compute FLOP-bound ({per:.3g} FLOPs per {self.unit.rstrip('s')}, "
                   f"{rates['flops'] / 1e9:.3g} GFLOP/s measured), the rest memory-bound")
            return point, point, point, how
        low, high = sorted((by_flops, by_bytes))
        how = ("FLOPs not counted by this workload: between all FLOP-bound and all memory-bound (geometric mean "
               "shown, the interval spans both)")
        return math.sqrt(low * high), low, high, how

    def memory_need(self, count: int) -> int | None:
        """Peak bytes per rank at ``count`` ranks, or None where the run recorded none."""
        peaks = self.last.get("peak_memory_bytes")
        if not peaks:
            return None
        peak = max(int(p) for p in peaks)
        if self.device == "cpu":
            peak = max(0, peak - _torch_rss())
        params = self.last.get("params")
        n = int(self.last["world_size"])
        if self.strategy in ("fsdp", "hsdp") and params:
            peak += int(STATE_BYTES * params * (1 / count - 1 / n))
        return peak

    # ------------------------------------------------------------------ this host's CPU ranks
    def loopback(self):
        """This host's gloo over loopback, measured once (a ping-pong sweep on two CPU ranks)."""
        from multigpu.bench.predict import LOOPBACK_NAME, Link
        from multigpu.doctor.pingpong import measure_link

        if getattr(self, "_loopback", None) is None:
            fig = measure_link()
            self._loopback = Link(LOOPBACK_NAME, fig["alpha_s"], fig["bandwidth"], "measured by a ping-pong sweep")
        return self._loopback

    def cpu_step(self, count: int, threads: int | None) -> dict[str, Any]:
        """``count`` ranks on this host's CPU with ``threads`` each: bench --predict's model on this host (its
        cores shared, the cores' bound), the compute carried from the measured thread count to ``threads`` by the
        CPU's own roofline (a matmul and a copy measured at both thread counts)."""
        from multigpu.bench.predict import busy_cores, predict

        if self.device != "cpu":
            raise ConfigError("plan --gpus cpu: this folder was measured on GPUs; valid: a folder measured on this "
                              "host's CPU ranks")
        cores = int(self.host.get("cores") or 1)
        sizes = sorted({r["world_size"] for r in self.runs})
        fitted = self.threads()
        threads = threads or max(1, cores // count)
        # the host's crowding as at the measured thread count; another thread count changes a rank's compute by
        # the roofline (measured alone: the contention of a rank's own threads with other work shows there)
        pred = predict(self.runs, [count], self.loopback(), cpu_ranks=True, cores=cores, threads=fitted,
                       other_work=busy_cores(self.runs, sizes, cores), fit_on=sizes)
        row = pred["rows"][0]
        slow = row["compute_s"] + row["imbalance_s"]
        factor, how = 1.0, f"{threads} thread(s) per rank, as measured"
        if threads != fitted:
            rates = cpu_roofline(fitted, threads)
            at, to = rates[fitted], rates[threads]
            items = pred["compute_fit"]["items_per_rank"][count]
            per = self.flops_per_item
            share = min(1.0, per * items / at["flops"] / slow) if per and slow > 0 else 0.5
            factor = share * at["flops"] / to["flops"] + (1 - share) * at["bandwidth"] / to["bandwidth"]
            how = (f"{threads} thread(s) per rank against {fitted} measured: compute x {factor:.2f} by this CPU's "
                   f"roofline ({share:.0%} FLOP-bound{'' if per else ', FLOPs not counted: half assumed'})")
        step = row["step_time_s"] + slow * (factor - 1)
        per_step = pred["compute_fit"]["items_per_rank"][count] * count
        return {"compute_s": slow * factor, "comm_s": row["latency_s"] + row["bandwidth_s"],
                "latency_s": row["latency_s"], "bandwidth_s": row["bandwidth_s"],
                "exposed_comm_s": row["latency_s"] + row["bandwidth_s"], "step_s": step,
                "items_per_step": per_step, "items_per_s": per_step / step if step > 0 else 0.0,
                "memory": None, "memory_have": None, "fits": None, "roofline": how, "bottleneck": row["bottleneck"],
                "fit_errors": []}

    # ------------------------------------------------------------------ one step on a cluster
    def step(self, cluster, catalog, precision: str, threads: int | None = None) -> dict[str, Any]:
        from multigpu.bench.predict import predict
        from multigpu.plan.model import net_of

        if cluster.gpu.key == "cpu":
            return self.cpu_step(cluster.count, threads)

        node_link = cluster.node_link or catalog.link(cluster.gpu.node_link)
        net = net_of(cluster, node_link)
        sizes = sorted({r["world_size"] for r in self.runs})
        pred = predict(self.runs, [cluster.count], net.link, cpu_ranks=False, ranks_per_node=net.per_node,
                       node_link=net.node_link, fit_on=sizes)
        row = pred["rows"][0]
        measured_compute = row["compute_s"] + row["imbalance_s"]
        items = pred["compute_fit"]["items_per_rank"][cluster.count]
        point, low, high, how = self.scale(cluster.gpu, precision, measured_compute, items, catalog)
        compute = measured_compute * point
        comm = row["latency_s"] + row["bandwidth_s"]
        overlap = OVERLAP.get(self.strategy or "", 0.0)
        exposed = max(0.0, comm - overlap * compute)
        step = compute + exposed
        per_step = items * cluster.count
        need = self.memory_need(cluster.count)
        have = cluster.gpu.memory_bytes
        return {"compute_s": compute, "comm_s": comm, "latency_s": row["latency_s"], "bandwidth_s": row["bandwidth_s"],
                "exposed_comm_s": exposed, "step_s": step, "step_low_s": measured_compute * low + exposed,
                "step_high_s": measured_compute * high + max(0.0, comm - overlap * measured_compute * high),
                "items_per_step": per_step, "items_per_s": per_step / step if step > 0 else 0.0,
                "memory": {"total": need} if need is not None else None, "memory_have": have,
                "fits": None if need is None else need <= have, "roofline": how,
                "bottleneck": "communication" if exposed > 0 else "compute",
                "fit_errors": [r["error"] for r in pred["rows"] if r.get("error") is not None]}
