"""Run a workload at each world size and collect what it measured (runs in the launcher).

    result = run_bench(BenchConfig(nproc=(1, 2)), LaunchConfig(cpu=True), resolve_target("x.py", []), out_dir)

Each run is launched with its own run context (:mod:`multigpu.runtime.context`):
the run directory ``<out_dir>/np<N>_r<k>`` and the scaling (strong or weak).
A workload's ``StepMeter`` writes ``summary.json`` there; a script without one
is measured by its wall clock (worker start of the script to its end, on the
slowest rank: the launch and the interpreter's start are left out).
``bench.json`` (every run, the table rows, the verdicts) and ``bench.png``
(speedup vs ideal; compute/communication split) land in ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multigpu.bench.config import BenchConfig
from multigpu.bench.table import doubts, explain, scaling_rows, startup_rows
from multigpu.bench.workloads import Target
from multigpu.errors import MultigpuError
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import configs_for
from multigpu.units import NOT_MEASURED

__all__ = ["Launcher", "cpu_usage", "run_bench", "wall_summary", "write_bench"]


class Launcher:
    """Launches one target at any world size with a given run context: a script or module as it is, a workload
    through the job contract, its config checked for every world size up front (bad input fails before any run)."""

    def __init__(self, target: Target, configs: dict[int, LaunchConfig], *, scaling: str = "strong"):
        from multigpu.launch.devices import HostFacts, plan_devices
        from multigpu.runtime.context import RunContext

        self.target = target
        self.jobs = {}
        facts = HostFacts.probe()
        if target.workload:
            from multigpu.bench.scaling import configs_per_size
            from multigpu.jobs.command import load_workload_config, preload, prepare
            from multigpu.jobs.registry import get_workload

            workload = get_workload(target.target)
            preload(workload)
            cfg = load_workload_config(workload, target.config, list(target.args), dict(target.flags),
                                       defaults=workload.bench)
            cfgs = configs_per_size(cfg, scaling, sorted(configs))  # strong/weak as labelled, per world size
            self.jobs = {n: prepare(workload, cfgs[n], c, RunContext(scaling=scaling), spec=target.target,
                                    facts=facts) for n, c in configs.items()}
        # every world size's devices are planned now: one that cannot fit fails before the first run
        self.devices = {n: plan_devices(c, facts) for n, c in configs.items()} if not target.workload else {}
        self.configs = configs

    def __call__(self, n: int, run) -> None:
        """Run at ``n`` processes per node with the run context ``run``, and wait."""
        if self.target.workload:
            from multigpu.jobs.command import launch_job

            launch_job(self.jobs[n], run)
        else:
            from multigpu.launch import launch

            launch(self.configs[n], self.target.target, self.target.args, module=self.target.module, run=run,
                   devices=self.devices[n], require_group=True)  # N copies of a script measure nothing


def wall_summary(run_dir: Path, items: int) -> dict[str, Any] | None:
    """A summary from the worker wrapper's start and end times (``wall/rank*.json``) for a script with no
    StepMeter: one step of ``items`` items (1 under strong scaling, the world size under weak), lasting from the
    first rank's start to the last rank's end; None when no rank wrote its times."""
    times = []
    for path in sorted((run_dir / "wall").glob("rank*.json")):
        try:
            times.append(json.loads(path.read_text()))
        except ValueError:
            continue
    if not times:
        return None
    from multigpu.monitor.startup import job_startup

    launcher = _launcher_marks(run_dir)
    wall = max(t["end"] for t in times) - min(t["start"] for t in times)
    # a wall clock sees neither time in collectives nor time computing: those are None (not measured), not 0
    per_rank = [{"wall_s": t["end"] - t["start"], "comm_s": None, "busy_s": None, "items": items / len(times),
                 "steps": 1} for t in times]
    return {
        "unit": "runs", "measure": "wall", "world_size": len(times), "steps": 1, "warmup_steps": 0,
        "items": items, "wall_s": wall, "throughput": items / wall if wall > 0 else 0.0,
        "step_time_s": {"median": wall, "min": wall, "max": wall}, "comm_share": None, "imbalance": None,
        "start_skew_s": max(t["start"] for t in times) - min(t["start"] for t in times), "per_rank": per_rank,
        # no first step: the start-up shown ends where the script began (its group joined, if it made one)
        "startup": job_startup([{**launcher, **(t.get("marks") or {})} for t in times]),
    }


def _launcher_marks(run_dir: Path) -> dict[str, float]:
    """The launcher's start-up marks from the run's ``run.json`` ({} without them)."""
    try:
        found = json.loads((run_dir / "run.json").read_text()).get("startup")
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in found.items() if isinstance(v, (int, float))} if isinstance(found, dict) else {}


def _read_summary(run_dir: Path, world_size: int, items: int) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if path.is_file():
        return json.loads(path.read_text())
    summary = wall_summary(run_dir, items)
    if summary is None:
        raise MultigpuError(f"the run at {world_size} rank(s) finished without writing {path} or its wall times")
    return summary


def cpu_usage(run_dir: Path) -> dict[str, float] | None:
    """Mean CPU of the host (% of all cores) and of a rank (% of one core) over the sampler's records."""
    host, ranks = [], []
    for path in run_dir.glob("samples_node*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("cpu_percent") is not None:
                host.append(rec["cpu_percent"])
            ranks += [r["cpu_percent"] for r in rec.get("ranks", []) if r.get("cpu_percent") is not None]
    if not host or not ranks:
        return None
    return {"host_percent": sum(host) / len(host), "rank_percent": sum(ranks) / len(ranks)}


def _host() -> dict[str, Any]:
    import torch

    from multigpu.runtime.env import cpu_count

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0  # asks the driver: no CUDA context
    return {"hostname": socket.gethostname(), "cores": cpu_count(), "gpus": _gpu_names(count),
            "torch": torch.__version__}


def _gpu_names(count: int) -> list[str]:
    """The visible GPUs' names from NVML (nvidia-ml-py, optional). Not torch.cuda.get_device_name: it creates a
    CUDA context in this launcher process, which holds memory on GPU 0 beside the ranks' and fails on GPUs in
    exclusive-process mode."""
    if count == 0:
        return []
    unknown = ["unknown (pip install nvidia-ml-py to name it)"] * count
    try:
        import pynvml
    except ImportError:
        return unknown
    try:
        pynvml.nvmlInit()
        try:
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                     for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - NVML without a driver, or a broken install: the names stay unknown
        return unknown
    names = [n.decode() if isinstance(n, bytes) else n for n in names]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    picks = [int(v) for v in visible.split(",") if v.strip().isdigit()] if visible.strip() else list(range(count))
    return [names[i] if i < len(names) else unknown[0] for i in picks[:count]] or unknown


def run_bench(
    bench: BenchConfig,
    cfg: LaunchConfig,
    target: Target,
    out_dir: Path,
    *,
    command: list[str] | None = None,
    on_run: Callable[[int, int, Path], None] | None = None,
) -> dict[str, Any]:
    """Run every world size ``bench.repeat`` times, then write bench.json and bench.png. Returns bench.json's data."""
    from multigpu.launch import rundir
    from multigpu.runtime.context import RunContext
    from multigpu.runtime.env import cpu_count

    launcher = Launcher(target, configs_for(cfg, bench.nproc), scaling=bench.scaling)  # bad input fails here
    rundir.check_free_space(out_dir)
    cores = cpu_count()
    runs = []
    with rundir.hold(out_dir, fresh_only=True, hint="give a new folder"):  # one bench per folder
        for k in range(bench.repeat):  # repeats alternate the world sizes (1, 2, 1, 2): drift hits each alike
            for n in bench.nproc:
                run_dir = out_dir / f"np{n}_r{k}"
                if on_run:
                    on_run(n, k, run_dir)
                run = RunContext(run_dir=str(run_dir.resolve()), scaling=bench.scaling,
                                 record_wall=not target.workload)
                try:
                    launcher(n, run)
                except MultigpuError:
                    print(f"multigpu bench: the run at {n} rank(s) (repeat {k + 1}) failed; its folder: {run_dir}",
                          file=sys.stderr)
                    raise
                summary = _read_summary(run_dir, n, run.problem_scale(n * cfg.nnodes))
                result = {"world_size": summary.get("world_size", n * cfg.nnodes), "nproc_per_node": n,
                          "repeat": k, "run_dir": run_dir.name, "summary": summary, "cpu": cpu_usage(run_dir)}
                result["doubts"] = doubts(result, cores)
                runs.append(result)
        return write_bench(out_dir, bench, runs, command=command, target=target, cpu_only=cfg.cpu)


def _measure_notes(runs: list[dict[str, Any]]) -> list[str]:
    if any(r["summary"].get("measure") == "wall" for r in runs):
        return ["measured by wall clock: the script has no StepMeter, so each run counts as one item, timed from "
                "the script's start on the first rank to its end on the last (the launch itself is left out); "
                f"communication share and imbalance show {NOT_MEASURED} (not measured): they need a StepMeter "
                "(multigpu.monitor.StepMeter, as in examples/allreduce_dp.py), which also gives throughput per step"]
    return []


def write_bench(out_dir: Path, bench: BenchConfig, runs: list[dict[str, Any]], *,
                command: list[str] | None = None, target: Target | None = None, cpu_only: bool = False) -> dict[str, Any]:
    """Rows, verdicts and bench.json from the collected runs (``bench.png`` is drawn by the report's plots:
    :func:`multigpu.report.plots.save_bench_plot`)."""
    from multigpu.monitor import write_json_atomic

    host = _host()
    rows = scaling_rows(runs)
    result = {
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command or [],
        "target": dataclasses.asdict(target) if target else None,
        "scaling": bench.scaling,
        "nproc": list(bench.nproc),
        "repeat": bench.repeat,
        "unit": runs[0]["summary"].get("unit", "items") if runs else "items",
        "host": host,
        "rows": rows,
        "startup": startup_rows(runs),
        "notes": _measure_notes(runs) + explain(rows, cores=host["cores"], cpu_ranks=not host["gpus"] or cpu_only),
        "runs": runs,
    }
    write_json_atomic(out_dir / "bench.json", result)
    return result
