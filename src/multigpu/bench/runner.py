"""Run a workload at each world size and collect what its StepMeter measured (runs in the launcher).

    result = run_bench(BenchConfig(nproc=(1, 2)), LaunchConfig(cpu=True), resolve_target("x.py", []), out_dir)

Each run goes through :func:`multigpu.launch.launch` with
``MULTIGPU_RUN_DIR=<out_dir>/np<N>_r<k>`` and ``MULTIGPU_SCALING=strong|weak``
in the workers' environment; the workload's ``StepMeter`` writes
``summary.json`` there. ``bench.json`` (every run, the table rows, the
verdicts) and ``bench.png`` (speedup vs ideal; compute/communication split)
land in ``out_dir``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from multigpu.bench.config import BenchConfig
from multigpu.bench.table import explain, scaling_rows
from multigpu.bench.workloads import Target
from multigpu.errors import ConfigError, MultigpuError
from multigpu.launch.config import LaunchConfig

__all__ = ["configs_for", "cpu_usage", "launch_with_env", "run_bench", "write_bench"]


@contextlib.contextmanager
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """Workers inherit the launcher's environment: set ``extra`` for one launch, then restore."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launch_with_env(cfg: LaunchConfig, target: Target, env: dict[str, str]) -> None:
    """Launch ``target`` with ``env`` added to the workers' environment, and wait."""
    from multigpu.launch import launch

    with _environment(env):
        launch(cfg, target.target, target.args, module=target.module)


def configs_for(cfg: LaunchConfig, sizes: tuple[int, ...]) -> dict[int, LaunchConfig]:
    """The launch config of each world size; with ``--gpus``, the first N of the chosen GPUs.

    Raises ConfigError/DeviceError for a size the selection cannot serve, before anything runs.
    """
    if cfg.gpus is None:
        return {n: dataclasses.replace(cfg, nproc_per_node=n) for n in sizes}
    from multigpu.launch.devices import HostFacts, parse_gpus

    chosen = parse_gpus(cfg.gpus, HostFacts.probe().gpu_count)
    out = {}
    for n in sizes:
        if n > len(chosen):
            raise ConfigError(f"--nproc {n} needs {n} GPUs but --gpus {cfg.gpus} selects "
                              f"{len(chosen)}; valid: --nproc up to {len(chosen)}")
        # "1," is GPU 1; a bare "1" would mean one GPU
        out[n] = dataclasses.replace(cfg, nproc_per_node=n, gpus=",".join(map(str, chosen[:n])) + ",")
    return out


def _read_summary(run_dir: Path, world_size: int) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise MultigpuError(
            f"the run at {world_size} rank(s) finished without writing {path}: measure the workload's steps with "
            "multigpu.monitor.StepMeter and call meter.close() on every rank (it writes summary.json)"
        )
    return json.loads(path.read_text())


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

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"hostname": socket.gethostname(), "cores": cpu_count(), "gpus": gpus, "torch": torch.__version__}


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
    configs = configs_for(cfg, bench.nproc)  # bad input fails before any run
    runs = []
    for n in bench.nproc:
        for k in range(bench.repeat):
            run_dir = out_dir / f"np{n}_r{k}"
            if on_run:
                on_run(n, k, run_dir)
            env = {"MULTIGPU_RUN_DIR": str(run_dir.resolve()), "MULTIGPU_SCALING": bench.scaling}
            try:
                launch_with_env(configs[n], target, env)
            except MultigpuError:
                print(f"multigpu bench: the run at {n} rank(s) (repeat {k + 1}) failed; its folder: {run_dir}",
                      file=sys.stderr)
                raise
            summary = _read_summary(run_dir, n)
            runs.append({"world_size": summary.get("world_size", n * cfg.nnodes), "nproc_per_node": n,
                         "repeat": k, "run_dir": run_dir.name, "summary": summary, "cpu": cpu_usage(run_dir)})
    return write_bench(out_dir, bench, runs, command=command, target=target, cpu_only=cfg.cpu)


def write_bench(out_dir: Path, bench: BenchConfig, runs: list[dict[str, Any]], *,
                command: list[str] | None = None, target: Target | None = None, cpu_only: bool = False) -> dict[str, Any]:
    """Rows, verdicts, bench.json and the plot from the collected runs."""
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
        "notes": explain(rows, cores=host["cores"], cpu_ranks=not host["gpus"] or cpu_only),
        "runs": runs,
    }
    write_json_atomic(out_dir / "bench.json", result)
    try:
        from multigpu.report.plots import bench_figure, save_png

        save_png(bench_figure(result), out_dir / "bench.png")
        result["plot"] = "bench.png"
    except ImportError as exc:
        print(f"multigpu: no plot ({exc})", file=sys.stderr)
    return result
