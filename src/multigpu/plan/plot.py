"""The plan's Pareto plot: time to the target against cost (or GPU-hours without prices), one marker per option
(matplotlib, extra ``report``; in the launcher)."""

from __future__ import annotations

from typing import Any

__all__ = ["plan_figure"]

_COLORS = ("#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#B279A2", "#EECA3B", "#9D755D", "#BAB0AC")


def plan_figure(result: dict[str, Any]):
    """Time (hours, log) vs cost (log): each GPU type in its colour, sized by count; options that do not fit
    hollow; the Pareto front (nothing both faster and cheaper) joined; the deadline dashed; the best ringed."""
    from multigpu.report.plots import new_figure

    fig, (ax,) = new_figure(7.5, 4.8)
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
