"""Plots for bench and report (matplotlib, extra ``report``; runs in the launcher).

Built with matplotlib's object API on the Agg canvas: no pyplot state, no
display needed (headless machines), and safe to call from any thread.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from multigpu.bench.table import shown

__all__ = ["bench_figure", "png_base64", "save_png", "throughput_figure", "utilization_figure"]

_IDEAL = "#888888"
_COMPUTE = "#4C78A8"
_COMM = "#F58518"


def _nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def _figure(width: float, height: float, ncols: int = 1, nrows: int = 1):
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'multigpu[report]'") from None
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def save_png(fig, path: str | Path) -> Path:
    """Write ``fig`` as PNG through a temporary file and a rename."""
    from multigpu.files import atomic_path

    with atomic_path(path, keep_suffix=True) as tmp:
        fig.savefig(tmp, format="png")
    return Path(path)


def png_base64(fig) -> str:
    """``fig`` as a base64 PNG, for ``<img src="data:image/png;base64,...">``."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def bench_figure(result: dict[str, Any]):
    """Speedup vs ideal (left) and the step time split into compute and communication (right)."""
    rows = result["rows"]
    sizes = [r["world_size"] for r in rows]
    fig, (ax1, ax2) = _figure(10, 4, ncols=2)
    ax1.plot(sizes, [r["ideal"] for r in rows], "--", color=_IDEAL, label="ideal")
    ax1.plot(sizes, [r["speedup"] for r in rows], "o-", color=_COMPUTE, label="measured (median)")
    if rows and rows[0]["throughput_median"] > 0:
        base = rows[0]["throughput_median"]
        ax1.plot(sizes, [r["throughput_min"] / base for r in rows], "v", color=_COMPUTE, alpha=0.5, label="min")
    ax1.set(xlabel="world size (ranks)", ylabel="speedup", xticks=sizes,
            title=f"{result.get('scaling', 'strong')} scaling: speedup vs ideal")
    ax1.grid(alpha=0.3)
    ax1.legend()
    shares = [r["comm_share"] or 0.0 for r in rows]  # not measured (None): the whole step drawn as compute
    compute = [r["step_time_s"] * (1 - s) * 1000 for r, s in zip(rows, shares, strict=True)]
    comm = [r["step_time_s"] * s * 1000 for r, s in zip(rows, shares, strict=True)]
    labels = [str(s) for s in sizes]
    ax2.bar(labels, compute, color=_COMPUTE, label="compute")
    ax2.bar(labels, comm, bottom=compute, color=_COMM, label="communication")
    for i, r in enumerate(rows):
        ax2.annotate(f"{shown(r['comm_share'], '.0%')} comm", (i, compute[i] + comm[i]), ha="center", va="bottom", fontsize=8)
    top = max((c + m for c, m in zip(compute, comm, strict=True)), default=1.0)
    ax2.set(xlabel="world size (ranks)", ylabel="median step time (ms)", title="where a step's time goes",
            ylim=(0, top * 1.18 or 1.0))
    ax2.legend()
    return fig


def throughput_figure(runs: Sequence[tuple[str, list[dict[str, Any]]]], unit: str = "items"):
    """Throughput over steps, one line per run, from each run's metrics.jsonl records."""
    fig, (ax,) = _figure(10, 3.2)
    key = f"{unit}_per_s"
    for label, records in runs:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            ax.plot(*zip(*points, strict=True), "o-", label=label, markersize=3)
    ax.set(xlabel="step", ylabel=f"{unit}/s", title="throughput over time (all ranks)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    return fig


def utilization_figure(samples: list[dict[str, Any]], title: str = ""):
    """CPU of the host and of each rank, memory, and each GPU's utilization and memory, over time."""
    t0 = samples[0]["time"] if samples else 0.0
    t = [s["time"] - t0 for s in samples]
    has_gpus = any(s.get("gpus") for s in samples)
    fig, axes = _figure(10, 5.6 if has_gpus else 3.2, ncols=2, nrows=2 if has_gpus else 1)
    cpu, mem = axes[0], axes[1]
    cpu.plot(t, [_nan(s.get("cpu_percent")) for s in samples], color="black", label="host (all cores)")
    for rank in sorted({r["rank"] for s in samples for r in s.get("ranks", [])}):
        series = [next((r["cpu_percent"] for r in s.get("ranks", []) if r["rank"] == rank), None) for s in samples]
        cpu.plot(t, [_nan(v) for v in series], label=f"rank {rank} (% of a core)")
    cpu.set(xlabel="seconds", ylabel="CPU %", title=f"CPU {title}".strip())
    cpu.legend(fontsize=8)
    mem.plot(t, [s["memory_used_gib"] for s in samples], color="black", label="host used")
    for rank in sorted({r["rank"] for s in samples for r in s.get("ranks", [])}):
        series = [next((r["rss_gib"] for r in s.get("ranks", []) if r["rank"] == rank), None) for s in samples]
        mem.plot(t, [_nan(v) for v in series], label=f"rank {rank} resident")
    mem.set(xlabel="seconds", ylabel="GiB", title=f"memory {title}".strip())
    mem.legend(fontsize=8)
    if has_gpus:
        util, gmem = axes[2], axes[3]
        for index in sorted({g["index"] for s in samples for g in s.get("gpus", [])}):
            def series(key, _i=index):
                vals = [next((g[key] for g in s.get("gpus", []) if g["index"] == _i), None) for s in samples]
                return [_nan(v) for v in vals]

            util.plot(t, series("util_percent"), label=f"GPU {index}")
            gmem.plot(t, series("memory_used_gib"), label=f"GPU {index}")
        util.set(xlabel="seconds", ylabel="utilization %", title="GPU utilization", ylim=(0, 105))
        gmem.set(xlabel="seconds", ylabel="GiB", title="GPU memory used")
        util.legend(fontsize=8)
        gmem.legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    return fig
