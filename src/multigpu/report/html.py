"""Build the self-contained HTML report of a run or a bench folder (runs in the launcher).

    multigpu report runs/bench/20261122-101500 -o report.html

One file, no external resources: plots are embedded as base64 PNG. It shows
the run's configuration, the scaling table, verdicts and plots (bench folders),
throughput over time (``metrics.jsonl``), CPU/GPU utilization per device over
time (``samples_node*.jsonl``), and the communication share and load imbalance
of every run (``summary.json``); a bench run with ``--predict`` adds the predicted rows, the interconnect, the
assumptions and what the prediction cannot know; a folder holding ``plan.json`` (``multigpu plan -o DIR``) adds the
plan: its options, the best one, the time-vs-cost plot and the assumptions.
"""

from __future__ import annotations

import contextlib
import datetime
import html
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from multigpu.errors import ConfigError
from multigpu.files import read_jsonl, write_text_atomic
from multigpu.units import NOT_MEASURED, fmt_rate, shown

__all__ = ["build_report", "load_run", "write_report"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.8em 0; } th, td { border: 1px solid #ccc; padding: 0.3em 0.7em; }
th { background: #f3f3f3; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.meta { color: #666; } .slower { color: #b00020; font-weight: bold; } pre { background: #f6f6f6; padding: 0.8em; }
img { max-width: 100%; border: 1px solid #eee; margin: 0.5em 0; }
"""

# Marks every image once the page has loaded: data-decoded="yes" when it decoded (checked by the tests).
_SCRIPT = """
window.addEventListener("load", function () {
  var imgs = document.querySelectorAll("img"), ok = 0;
  imgs.forEach(function (img) {
    var good = img.complete && img.naturalWidth > 0;
    img.setAttribute("data-decoded", good ? "yes" : "no");
    if (good) { ok += 1; }
  });
  document.body.setAttribute("data-images", ok + "/" + imgs.length);
});
"""


_VALID = "give a folder written by `multigpu bench` or by a workload run"


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A file that does not hold what multigpu writes: one line naming it and what is wrong, not a KeyError."""
    try:
        yield
    except KeyError as exc:
        raise ConfigError(f"report: {path} has no {exc} entry, so it was not written by multigpu (or was edited); "
                          f"{_VALID}") from None
    except (TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ConfigError(f"report: {path} holds a value of the wrong kind ({type(exc).__name__}: {first}); "
                          f"{_VALID}") from None


def _read_json(path: Path, kind: type = dict) -> Any:
    """The JSON in ``path`` (None when there is no such file); one line when it is not JSON or not a ``kind``."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(errors="replace"))
    except ValueError as exc:
        raise ConfigError(f"report: {path} is not valid JSON ({exc}); {_VALID}") from None
    except RecursionError:
        raise ConfigError(f"report: {path} is nested deeper than Python's JSON reader goes; {_VALID}") from None
    except OSError as exc:
        raise ConfigError(f"report: {path} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(data, kind):
        raise ConfigError(f"report: {path} holds a {type(data).__name__}, not a JSON object; {_VALID}")
    return data


def _samples(run_dir: Path) -> list[dict[str, Any]]:
    records = [s for p in sorted(run_dir.glob("samples_node*.jsonl")) for s in read_jsonl(p)]
    return sorted((s for s in records if isinstance(s.get("time"), (int, float))), key=lambda s: s["time"])


def load_run(run_dir: Path) -> dict[str, Any]:
    """What one run folder holds: summary, config, metrics lines, samples (all nodes, by time), profile traces.

    A torn last line in a ``.jsonl`` file (a writer killed mid-line) is skipped.
    """
    return {
        "name": run_dir.name,
        "path": run_dir,
        "summary": _read_json(run_dir / "summary.json"),
        "config": _read_json(run_dir / "run.json"),
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
        "samples": _samples(run_dir),
        "traces": sorted(str(p.relative_to(run_dir)) for p in (run_dir / "profile").glob("*.json")),
    }


def _bench_runs(root: Path, bench: dict[str, Any]) -> list[dict[str, Any]]:
    """The run folders ``bench.json`` lists, each a plain sub-folder of ``root`` (never a path outside it)."""
    path = root / "bench.json"
    with _reading(path):
        names = [r["run_dir"] for r in bench["runs"]]
    inside = root.resolve()
    folders = []
    for name in names:
        folder = (root / str(name)).resolve()
        if not isinstance(name, str) or folder.parent != inside:
            raise ConfigError(f"report: {path} names the run folder {name!r}, which is not a folder inside "
                              f"{root}; a bench folder holds its runs itself (np<N>_r<k>); {_VALID}")
        folders.append(folder)
    return [load_run(f) for f in folders]


def _img(fig, alt: str) -> str:
    from multigpu.report.plots import png_base64

    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{png_base64(fig)}">'


def _table(header: list[str], rows: list[list[str]], numeric_from: int = 1) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f'<td{" class=num" if i >= numeric_from else ""}>{html.escape(c)}</td>'
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _scaling_section(bench: dict[str, Any]) -> str:
    from multigpu.report.plots import bench_figure

    unit = bench.get("unit", "items")
    rows = [[str(r["world_size"]), fmt_rate(r["throughput_median"]), fmt_rate(r["throughput_min"]),
             f"{r['speedup']:.2f}x", f"{r['ideal']:.0f}x", f"{r['efficiency']:.0%}",
             f"{r['step_time_s'] * 1000:.1f}", shown(r["comm_share"], ".0%"), shown(r["imbalance"], ".2f")]
            for r in bench["rows"]]
    notes = "".join(f'<li class="{"slower" if n.startswith("SLOWER") else ""}">{html.escape(n)}</li>'
                    for n in bench.get("notes", []))
    return (
        f"<h2>Scaling ({html.escape(bench.get('scaling', 'strong'))})</h2>"
        + _table(["ranks", f"{unit}/s median", f"{unit}/s min", "speedup", "ideal", "efficiency", "step ms",
                  "comm share", "imbalance"], rows)
        + (f"<ul>{notes}</ul>" if notes else "")
        + _img(bench_figure(bench), "speedup vs ideal, and compute/communication split"
               + (", measured and predicted" if bench.get("prediction") else ""))
        + (_prediction_section(bench["prediction"]) if bench.get("prediction") else "")
        + _startup_section(bench.get("startup") or [])
    )


def _startup_section(rows: list[dict[str, Any]]) -> str:
    """Where start-up went (``bench.json``'s ``startup`` rows, or one run's), as a table and a bar per world size."""
    from multigpu.monitor.startup import PARTS, TORCH_IMPORT
    from multigpu.report.plots import startup_figure

    if not rows:
        return ""
    names = [name for name, _, _ in PARTS if any(name in r["parts_s"] for r in rows)]
    body = [[str(r["world_size"]), *(shown(r["parts_s"].get(n), ".2f") for n in names),
             shown(r.get("to_first_step_s"), ".2f"), shown(r.get("first_step_s"), ".2f"),
             shown(r.get("torch_import_s"), ".2f")] for r in rows]
    words = "".join(f"<li><b>{html.escape(name)}</b>: {html.escape(what)}</li>" for name, _, what in PARTS
                    if name in names)
    return (
        "<h3>Start-up: from the command to the first step</h3>"
        + _table(["ranks", *(f"{n} s" for n in names), "to first step s", "first step s", "torch import s"], body)
        + f"<ul>{words}<li><b>torch import</b>: {html.escape(TORCH_IMPORT)}</li></ul>"
        + _img(startup_figure(rows), "start-up parts per world size")
    )


def _ms(seconds: float | None) -> str:
    return shown(None if seconds is None else seconds * 1000, ".2f")


def _short_time(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def _prediction_section(pred: dict[str, Any]) -> str:
    """The predicted rows (``bench --predict``), the interconnect, the assumptions and what the model cannot know."""
    from multigpu.bench.predict import row_label
    from multigpu.report.plots import pred_parts

    parts = pred_parts(pred["rows"])
    rows = [[row_label(r), _ms(r["step_time_s"]), f"{r['speedup']:.2f}x", f"{r['efficiency']:.0%}",
             *(_ms(r.get(f"{p}_s")) for p in parts), str(r.get("bottleneck", "")),
             _ms(r.get("measured_step_time_s")), shown(r.get("error"), "+.0%")]
            for r in pred["rows"]]
    link = pred["link"]
    fit = ", ".join(map(str, pred["fit_on"]))
    sweep = pred.get("ping_pong_one_way_s") or {}
    return (
        "<h3>Predicted scaling</h3>"
        + (f"<p><b>Not a prediction: the runs it is fitted on cannot be trusted</b> "
           f"({html.escape('; '.join(pred['distrusted']))}). Rerun the bench with --repeat 3 on a quieter machine."
           "</p>" if pred.get("distrusted") else "")
        + f"<p>fitted on the measured world size(s) {html.escape(fit)}; interconnect: "
        f"<b>{html.escape(str(link['name']))}</b>, latency {link['alpha_s'] * 1e6:.3g} us and "
        f"{link['bandwidth'] / 1e9:.3g} GB/s per rank and direction ({html.escape(str(link['source']))})</p>"
        + ('<p class="meta">ping-pong one-way times it was measured from: '
           + html.escape(", ".join(f"{int(b):,} B {_short_time(t)}" for b, t in sweep.items())) + "</p>"
           if sweep else "")
        + _table(["ranks", "step ms", "speedup", "efficiency", *(f"{p} ms" for p in parts), "bottleneck",
                  "measured step ms", "error"], rows)
        + "<h4>Assumptions</h4><ul>" + "".join(f"<li>{html.escape(str(a))}</li>" for a in pred["assumptions"])
        + "</ul><h4>What the prediction cannot know</h4><ul>"
        + "".join(f"<li>{html.escape(str(c))}</li>" for c in pred["cannot_know"]) + "</ul>"
    )


def _stragglers(summary: dict[str, Any]) -> str:
    """Ranks persistently slower than the others (which, by how much, since which step), or that none was."""
    from multigpu.monitor.stragglers import describe

    found = summary.get("stragglers")
    if "stragglers" not in summary or summary.get("world_size", 1) < 2:
        return ""
    if found is None:
        return f'<p class="meta">stragglers: {NOT_MEASURED} (the ranks\' communication time was not measured)</p>'
    if not found:
        return '<p class="meta">stragglers: none (no rank was persistently slower than the others)</p>'
    return "".join(f"<p><b>straggler:</b> {html.escape(describe(s))}</p>" for s in found)


def _run_section(run: dict[str, Any], with_startup: bool = True) -> str:
    """One run's figures; ``with_startup``: its start-up too (a bench folder shows them together instead)."""
    from multigpu.report.plots import utilization_figure

    parts = [f"<h3>{html.escape(run['name'])}</h3>"]
    s = run["summary"]
    if s:
        with _reading(run["path"] / "summary.json"):
            parts.append(_table(
                ["world size", "steps", f"{s.get('unit', 'items')}/s", "median step ms", "comm share", "imbalance"],
                [[str(s["world_size"]), str(s["steps"]), f"{s['throughput']:,.1f}",
                  f"{s['step_time_s']['median'] * 1000:.1f}", shown(s["comm_share"], ".1%"), shown(s["imbalance"], ".2f")]]))
            parts.append(_table(["rank", "wall s", "comm s", "busy s", "items"],
                                [[str(i), shown(r.get("wall_s"), ".3f"), shown(r.get("comm_s"), ".3f"),
                                  shown(r.get("busy_s"), ".3f"), f"{r['items']:g}"]
                                 for i, r in enumerate(s.get("per_rank", []))]))
            parts.append(_stragglers(s))
        if with_startup and isinstance(s.get("startup"), dict) and isinstance(s["startup"].get("parts_s"), dict):
            with _reading(run["path"] / "summary.json"):
                parts.append(_startup_section([{"world_size": s["world_size"], **s["startup"]}]))
    if run["samples"]:
        with _reading(run["path"] / "samples_node*.jsonl"):
            parts.append(_img(utilization_figure(run["samples"], f"({run['name']})"),
                              f"utilization per device over time, {run['name']}"))
    else:
        parts.append('<p class="meta">no device samples (samples_node*.jsonl) in this run</p>')
    if run["traces"]:
        parts.append("<p>profiler traces (open in https://ui.perfetto.dev): "
                     + ", ".join(html.escape(t) for t in run["traces"]) + "</p>")
    return "".join(parts)


def build_report(run_dir: str | Path) -> str:
    """The HTML page for a bench folder (``bench.json``) or a single run folder (``summary.json``)."""
    from multigpu.report.plots import throughput_figure

    root = Path(run_dir)
    if not root.is_dir():
        raise ConfigError(f"report: {run_dir} is not a folder; give a run or bench folder such as runs/bench/<time>")
    bench = _read_json(root / "bench.json")
    plan = _read_json(root / "plan.json")
    if bench is not None:
        runs = _bench_runs(root, bench)
    elif (root / "summary.json").is_file() or list(root.glob("samples_node*.jsonl")):
        runs = [load_run(root)]
    elif plan is not None:
        runs = []
    else:
        raise ConfigError(f"report: {run_dir} holds neither bench.json nor summary.json (nor plan.json); give a folder "
                          "written by `multigpu bench`, by a workload run (its run directory) or by `multigpu plan -o`")
    title = f"multigpu report: {root.resolve().name}"
    parts = [f"<h1>{html.escape(title)}</h1>",
             f'<p class="meta">{html.escape(str(root.resolve()))} &middot; generated '
             f"{datetime.datetime.now().isoformat(timespec='seconds')}</p>"]
    if plan is not None:
        with _reading(root / "plan.json"):
            parts.append(_plan_section(plan))
    if not runs:
        return _page(title, parts)
    parts.append("<h2>Configuration</h2>")
    if bench is not None:
        cfg = {k: bench.get(k) for k in ("command", "target", "scaling", "nproc", "repeat", "unit", "host", "created")}
        parts.append(f"<pre>{html.escape(json.dumps(cfg, indent=2))}</pre>")
    for run in runs:
        if run["config"] is not None:
            parts.append(f"<p>{html.escape(run['name'])}: run.json</p>"
                         f"<pre>{html.escape(json.dumps(run['config'], indent=2))}</pre>")
    if bench is not None:
        with _reading(root / "bench.json"):
            parts.append(_scaling_section(bench))
    with_metrics = [(r["name"], r["metrics"]) for r in runs if r["metrics"]]
    parts.append("<h2>Throughput over time</h2>")
    if with_metrics:
        unit = next((str(r["summary"].get("unit", "items")) for r in runs if r["summary"]), "items")
        with _reading(root / "metrics.jsonl" if bench is None else root / "np*" / "metrics.jsonl"):
            parts.append(_img(throughput_figure(with_metrics, unit), "throughput over time"))
    else:
        parts.append('<p class="meta">no metrics.jsonl (the workload\'s StepMeter had log_every=0)</p>')
    parts.append("<h2>Runs: communication, imbalance, utilization</h2>")
    parts += [_run_section(r, with_startup=bench is None) for r in runs]
    return _page(title, parts)


def _page(title: str, parts: list[str]) -> str:
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            + "\n".join(parts) + f"<script>{_SCRIPT}</script></body></html>")


def _plan_section(plan: dict[str, Any]) -> str:
    """``multigpu plan``'s options (``plan.json``): the table, the best option, the plot, the assumptions."""
    def gib(b):
        return "—" if b is None else f"{b / 2**30:.1f}"

    def hours(s):
        return f"{s / 3600:,.1f} h"

    cur = (plan.get("prices") or {}).get("currency") or ""
    rows = []
    for o in plan["options"]:
        memory = (f"does not fit: needs {gib(o['need_bytes'])} GiB of {gib(o['have_bytes'])}" if o["fits"] is False
                  else "not measured" if o["fits"] is None else f"{gib(o['need_bytes'])} of {gib(o['have_bytes'])}")
        rows.append([f"{o['count']} x {o['gpu']}", str(o["nodes"]), f"{o['step_s'] * 1e3:,.1f}",
                     f"{o['items_per_s']:,.0f}", f"{hours(o['time_s'])} ({hours(o['time_low_s'])}-"
                     f"{hours(o['time_high_s'])})", memory, f"{o['gpu_hours']:,.0f}",
                     "—" if o["cost"] is None else f"{o['cost']:,.0f}",
                     "—" if o["kwh"] is None else f"{o['kwh']:,.0f}", str(o["bottleneck"])])
    out = [f"<h2>Plan: {html.escape(str(plan['size']['text']))}</h2>",
           _table(["GPUs", "nodes", "step (ms)", f"{plan['unit']}/s", "time (95% interval)", "memory per GPU (GiB)",
                   "GPU-hours", f"cost {cur}".strip(), "kWh", "bound by"], rows)]
    best = plan.get("best")
    if best:
        out.append(f"<p><b>best{' that meets the deadline' if plan.get('deadline_s') else ''}:</b> "
                   f"{best['count']} x {html.escape(str(best['gpu']))}, {hours(best['time_s'])}</p>")
    try:
        from multigpu.report.plots import plan_figure

        out.append(_img(plan_figure(plan), "plan: time vs cost"))
    except ImportError as exc:
        out.append(f'<p class="meta">{html.escape(str(exc))}</p>')
    out.append("<p>Assumptions:</p><ul>" + "".join(f"<li>{html.escape(str(a))}</li>" for a in plan["assumptions"])
               + "</ul><p>The plan cannot know:</p><ul>"
               + "".join(f"<li>{html.escape(str(a))}</li>" for a in plan["cannot_know"]) + "</ul>")
    return "\n".join(out)


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the page (default ``<run_dir>/report.html``) through a temporary file and a rename.

    A number no plot or table can hold (``1e400`` read as an int, say) is one line, as any other value of the
    wrong kind."""
    try:
        page = build_report(run_dir)
    except (OverflowError, RecursionError) as exc:
        raise ConfigError(f"report: {run_dir} holds a value multigpu cannot show ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else 'too deep'}); {_VALID}") from None
    return write_text_atomic(Path(out) if out is not None else Path(run_dir) / "report.html", page)
