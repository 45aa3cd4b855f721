"""Plots for bench and report (matplotlib, extra ``report``; runs in the launcher).

Built with matplotlib's object API on the Agg canvas: no pyplot state, no
display needed (headless machines), and safe to call from any thread.
"""

from __future__ import annotations

import base64
import io
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from multigpu.units import shown

__all__ = ["bench_figure", "plain_text", "plan_figure", "png_base64", "pred_parts", "save_bench_plot", "save_png",
           "startup_figure", "throughput_figure", "utilization_figure"]

_IDEAL = "#888888"
_COMPUTE = "#4C78A8"
_COMM = "#F58518"
_WHOLE = "#BAB0AC"
"""A time that was not split into compute and communication (a wall-clock-timed script; comm not measured)."""
_PRED = "#54A24B"
_PRED_COLORS = {"compute": _COMPUTE, "imbalance": "#B279A2", "latency": "#E45756", "bandwidth": _COMM}
_EXTRA_COLORS = ("#72B7B2", "#EECA3B", "#9D755D", "#BAB0AC")
_WIDE = 16
"""World sizes (or step times) spanning more than this factor are drawn on log-2 axes (or as shares)."""


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


def plain_text(fig) -> None:
    """Show every text of ``fig`` as written: run names, units and labels come from the user's folders and files,
    and matplotlib would read ``$...$`` in them as mathtext (``$\\macro$`` then fails to render)."""
    from matplotlib.text import Text

    for text in fig.findobj(Text):
        text.set_parse_math(False)


def save_png(fig, path: str | Path) -> Path:
    """Write ``fig`` as PNG through a temporary file and a rename."""
    from multigpu.files import atomic_path

    plain_text(fig)
    with atomic_path(path, keep_suffix=True) as tmp:
        fig.savefig(tmp, format="png")
    return Path(path)


def png_base64(fig) -> str:
    """``fig`` as a base64 PNG, for ``<img src="data:image/png;base64,...">``."""
    plain_text(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def bench_figure(result: dict[str, Any]):
    """Speedup vs ideal (left) and where a step's time goes (right).

    With ``result["prediction"]`` (``bench --predict``) the predicted sizes are drawn too: hollow markers on a
    dashed line (its step time error written beside a size also measured), hatched bars split into the model's
    parts, and a caption of its assumptions. World sizes spanning more than 16x get log-2 axes; step times
    spanning more than 16x are drawn as shares of the step, its time written above each bar."""
    pred = result.get("prediction") or {}
    prows = pred.get("rows") or []
    fig, (ax1, ax2) = _figure(10, 4.8 if prows else 4, ncols=2)
    _speedup_panel(ax1, result, pred, prows)
    _split_panel(ax2, result["rows"], prows)
    if prows:
        fig.supxlabel(_caption(pred), fontsize=8, color="#444444")
    return fig


def _speedup_panel(ax, result: dict[str, Any], pred: dict[str, Any], prows: list[dict[str, Any]]) -> None:
    rows = result["rows"]
    sizes = [r["world_size"] for r in rows]
    ideal = {r["world_size"]: r["ideal"] for r in [*rows, *prows]}
    every = sorted(ideal)
    ax.plot(every, [ideal[n] for n in every], "--", color=_IDEAL, label="ideal")
    ax.plot(sizes, [r["speedup"] for r in rows], "o-", color=_COMPUTE, label="measured (median)")
    if rows and rows[0]["throughput_median"] > 0:
        base = rows[0]["throughput_median"]
        ax.plot(sizes, [r["throughput_min"] / base for r in rows], "v", color=_COMPUTE, alpha=0.5, label="min")
    if prows:
        ax.plot([r["world_size"] for r in prows], [r["speedup"] for r in prows], "o--", color=_PRED,
                markerfacecolor="white", markeredgewidth=1.5, markersize=8, label=_predicted_label(pred))
        for r in prows:
            if r.get("error") is not None:  # a size also measured: how far off the predicted step time was
                ax.annotate(f"step {r['error']:+.0%}\nvs measured", (r["world_size"], r["speedup"]), xytext=(7, -5),
                            textcoords="offset points", fontsize=7, color=_PRED, va="top")
    ax.set(xlabel="world size (ranks)", ylabel="speedup",
           title=f"{result.get('scaling', 'strong')} scaling: speedup vs ideal")
    if every and every[-1] > _WIDE * every[0]:
        _log2(ax, "x", every)
        _log2(ax, "y")
        ys = [y for y in [*ideal.values(), *(r["speedup"] for r in [*rows, *prows])] if y > 0]
        low, high = min(ys) / 1.5, max(ys) * 1.5
        ax.set_ylim(low, low * (high / low) ** 1.45)  # the top third left free for the legend
    else:
        ax.set_xticks(every)
    ax.grid(alpha=0.3)
    if prows:
        ax.legend(fontsize=8, loc="upper left")  # above the ideal line, which the predicted sizes stretch out
    else:
        ax.legend()


class _Bar(NamedTuple):
    world_size: int
    label: str
    parts: dict[str, float]
    """Seconds per step in each part (stacked in the order of the panel's series)."""
    predicted: bool
    step_s: float
    note: str
    """Written above the bar: the measured communication share, or the predicted bottleneck."""


def _split_panel(ax, rows: list[dict[str, Any]], prows: list[dict[str, Any]]) -> None:
    measured = {r["world_size"]: r for r in rows}
    predicted = {r["world_size"]: r for r in prows}
    parts = pred_parts(prows)
    wall = bool(rows) and all(r.get("measure") == "wall" for r in rows)
    # a script timed by its wall clock: each bar is the whole run (start-up, imports, every step), not a step
    whole = "whole run, wall clock (not split)" if wall else "step, not split (communication not measured)"
    bars = []
    for n in sorted(measured.keys() | predicted.keys()):
        if n in measured:
            r = measured[n]
            if r["comm_share"] is None:  # not measured: the time as a whole, not passed off as compute
                split = {whole: r["step_time_s"]}
            else:
                split = {"compute": r["step_time_s"] * (1 - r["comm_share"]),
                         "communication": r["step_time_s"] * r["comm_share"]}
            bars.append(_Bar(n, str(n), split, False, r["step_time_s"], f"{shown(r['comm_share'], '.0%')} comm"))
        if n in predicted:
            r = predicted[n]
            bars.append(_Bar(n, f"{n}\npredicted", {p: float(r.get(f"{p}_s") or 0.0) for p in parts}, True,
                             r["step_time_s"], str(r.get("bottleneck") or "")))
    steps = [b.step_s for b in bars if b.step_s > 0]
    shares = bool(steps) and max(steps) > _WIDE * min(steps)  # bars too far apart to read on one time axis
    scale = [100 / (sum(b.parts.values()) or 1.0) if shares else 1000 for b in bars]
    bottom = [0.0] * len(bars)
    series = [("compute", False, _COMPUTE), ("communication", False, _COMM), (whole, False, _WHOLE)]
    series += [(p, True, _PRED_COLORS.get(p) or _EXTRA_COLORS[i % len(_EXTRA_COLORS)]) for i, p in enumerate(parts)]
    for part, is_pred, color in series:
        idx = [i for i, b in enumerate(bars) if b.predicted == is_pred and part in b.parts]
        if not idx:
            continue
        heights = [bars[i].parts.get(part, 0.0) * scale[i] for i in idx]
        style = ({"facecolor": _to_rgba(color, 0.35), "edgecolor": color, "hatch": "///", "linewidth": 0}
                 if is_pred else {"color": color})
        ax.bar(idx, heights, bottom=[bottom[i] for i in idx], label=f"predicted {part}" if is_pred else part, **style)
        for i, h in zip(idx, heights, strict=True):
            bottom[i] += h
    # where a predicted size was also measured: the measured pace on its bar (the step the error is against: the
    # slowest rank's mean, which the measured bars' per-step median can sit above when ranks share cores)
    marked = [(i, predicted[b.world_size]["measured_step_time_s"]) for i, b in enumerate(bars)
              if b.predicted and predicted[b.world_size].get("measured_step_time_s")]
    for k, (i, seconds) in enumerate(marked):
        if not shares:
            ax.plot([i - 0.42, i + 0.42], [seconds * 1000] * 2, color="black", linewidth=2,
                    label="measured mean step" if k == 0 else None)
            bottom[i] = max(bottom[i], seconds * 1000)
    for i, b in enumerate(bars):
        note = _duration(b.step_s) if shares else b.note
        if shares and b.predicted:
            note += f"\n{b.note}"
        ax.annotate(note, (i, bottom[i]), ha="center", va="bottom", fontsize=7 if prows else 8)
    top = max(bottom, default=1.0) or 1.0
    ax.set_xticks(range(len(bars)), [b.label for b in bars], fontsize=8 if prows else None)
    unit = "run" if wall else "step"
    ax.set(xlabel="world size (ranks)" + ("; above a predicted bar: its bottleneck" if prows else ""),
           ylabel=f"share of the {unit} (%)" if shares else ("run time, wall clock (ms)" if wall
                                                               else "median step time (ms)"),
           title="the whole run's wall clock time (no StepMeter: not split)" if wall else "where a step's time goes",
           ylim=(0, top * (1.45 if prows else 1.18)))
    if shares:
        ax.set_yticks(range(0, 101, 20))
    ax.legend(fontsize=7 if prows else None, ncols=2 if len(series) > 3 else 1)


def startup_figure(rows: list[dict[str, Any]]):
    """Where start-up went: one horizontal bar per world size from the command (0 s) to the first step, cut into
    its parts (``bench.json``'s ``startup`` rows, or one run's as a one-row list), the first step drawn after it."""
    from multigpu.monitor.startup import PARTS

    names = [name for name, _, _ in PARTS if any(name in r["parts_s"] for r in rows)]
    colors = [_COMPUTE, _IDEAL, _COMM, "#B279A2", _PRED, *_EXTRA_COLORS]
    fig, (ax,) = _figure(10, 1.5 + 0.55 * len(rows))
    labels = [f"{r['world_size']} rank{'s' if r['world_size'] != 1 else ''}" for r in rows]
    left = [0.0] * len(rows)
    for k, name in enumerate([*names, "first step"]):
        widths = [_nan(r["parts_s"].get(name) if name != "first step" else r.get("first_step_s")) for r in rows]
        widths = [0.0 if w != w else w for w in widths]  # a part not measured takes no room
        ax.barh(range(len(rows)), widths, left=left, label=name,
                color=colors[k % len(colors)] if name != "first step" else "none",
                edgecolor="black" if name == "first step" else None, hatch="//" if name == "first step" else None)
        left = [a + w for a, w in zip(left, widths, strict=True)]
    for i, r in enumerate(rows):
        if r.get("to_first_step_s") is not None:
            ax.annotate(f"first step at {r['to_first_step_s']:.2f} s", (left[i], i), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set(xlabel="seconds from the command", title="start-up: from the command to the first step",
           xlim=(0, max(left, default=1.0) * 1.3 or 1.0))
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, ncols=min(len(names) + 1, 6), loc="outside lower center")
    return fig


def pred_parts(rows: list[dict[str, Any]]) -> list[str]:
    """The parts a predicted step is split into: the model's known ones first, then any other ``*_s`` number its
    rows carry (a newer model's), in the order they come."""
    parts = [p for p in _PRED_COLORS if any(f"{p}_s" in r for r in rows)]
    for r in rows:
        for key, value in r.items():
            if (key.endswith("_s") and key not in ("step_time_s", "measured_step_time_s") and key[:-2] not in parts
                    and isinstance(value, (int, float)) and not isinstance(value, bool)):
                parts.append(key[:-2])
    return parts


def _predicted_label(pred: dict[str, Any]) -> str:
    fit = ", ".join(map(str, pred.get("fit_on", [])))
    return f"predicted ({pred.get('link', {}).get('name', 'interconnect not named')}, fitted on N = {fit})"


def _caption(pred: dict[str, Any]) -> str:
    """The prediction's assumptions in short; ``multigpu report`` lists them all."""
    link = pred.get("link", {})
    figures = ""
    if isinstance(link.get("alpha_s"), (int, float)) and isinstance(link.get("bandwidth"), (int, float)):
        figures = f"latency {link['alpha_s'] * 1e6:.3g} us, {link['bandwidth'] / 1e9:.3g} GB/s per rank and direction, "
    text = (f"Predicted with an alpha-beta model of {link.get('name', 'an interconnect not named')} ({figures}"
            f"{link.get('source', 'source not given')}); compute fitted on the measured N = "
            f"{', '.join(map(str, pred.get('fit_on', [])))}; "
            + ("the job's collectives as counted there, not overlapped with compute" if pred.get("traffic_at")
               else "no communication counted (none measured on 1 rank)")
            + "; topology, congestion and memory not known. All assumptions: multigpu report.")
    return textwrap.fill(text, 150)


def _duration(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def _log2(ax, which: str, ticks: Sequence[int] | None = None) -> None:
    """``ax``'s ``which`` axis ("x" or "y") on a log-2 scale with plain numbers (at ``ticks`` when given)."""
    from matplotlib.ticker import FuncFormatter, NullLocator

    getattr(ax, f"set_{which}scale")("log", base=2)
    axis = getattr(ax, f"{which}axis")
    if ticks is not None:
        axis.set_ticks(list(ticks), [str(t) for t in ticks])
    else:
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_locator(NullLocator())


def _to_rgba(color: str, alpha: float):
    from matplotlib.colors import to_rgba

    return to_rgba(color, alpha)


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


def save_bench_plot(result: dict[str, Any], out_dir) -> None:
    """Draw ``bench.png`` from a bench's ``result`` (again after ``bench --predict`` added its prediction) and name it
    in ``result["plot"]``; without matplotlib, one line saying so and no plot. The bench measures; this draws."""
    import sys
    from pathlib import Path

    try:
        save_png(bench_figure(result), Path(out_dir) / "bench.png")
        result["plot"] = "bench.png"
    except ImportError as exc:
        print(f"multigpu: no plot ({exc})", file=sys.stderr)


# ---------------------------------------------------------------------------- the plan: time vs cost
_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D", "#BAB0AC")


def plan_figure(result: dict[str, Any]):
    """Time (hours, log) vs cost (log): each GPU type in its colour, sized by count; options that do not fit
    hollow; the Pareto front (nothing both faster and cheaper) joined; the deadline dashed; the best ringed."""
    fig, (ax,) = _figure(7.5, 4.8)
    key = "cost" if result["prices"] else "gpu_hours"
    label = f"cost ({result['prices']['currency']})" if result["prices"] else "GPU-hours (no prices given)"
    types = list(dict.fromkeys(o["gpu"] for o in result["options"]))
    for i, gpu in enumerate(types):
        mine = [o for o in result["options"] if o["gpu"] == gpu and o[key] is not None]
        color = _COLORS[i % len(_COLORS)]
        for fits in (True, False):
            pts = [o for o in mine if (o["fits"] is not False) == fits]
            if pts:
                ax.scatter([o["time_s"] / 3600 for o in pts], [o[key] for o in pts],
                           s=[18 + 6 * o["count"] ** 0.5 for o in pts], label=gpu if fits else None,
                           facecolors=color if fits else "none", edgecolors=color, alpha=0.85)
    front = [o for o in result["options"] if (o["gpu"], o["count"]) in {tuple(p) for p in result["pareto"]}]
    front.sort(key=lambda o: o["time_s"])
    if front:
        ax.plot([o["time_s"] / 3600 for o in front], [o[key] for o in front], color="#333333", lw=1,
                label="Pareto front")
    if result["deadline_s"]:
        ax.axvline(result["deadline_s"] / 3600, color="#b00020", ls="--", lw=1, label="deadline")
    best = result["best"]
    if best is not None and best[key] is not None:
        ax.scatter([best["time_s"] / 3600], [best[key]], s=220, facecolors="none", edgecolors="#b00020", lw=2,
                   label=f"best: {best['count']} x {best['gpu']}")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _pos: f"{v:,.0f}" if v >= 1 else f"{v:.2g}")  # the report draws text as written (no mathtext)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(plain)
        axis.set_minor_formatter(FuncFormatter(lambda v, _pos: ""))
    ax.set_xlabel(f"time to {result['size']['text']} (hours)")
    ax.set_ylabel(label)
    ax.set_title("multigpu plan: time vs cost (hollow: does not fit in memory)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="best")
    return fig
