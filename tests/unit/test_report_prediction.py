"""`bench --predict`'s prediction drawn in bench.png and listed in `multigpu report`.

The fixture is a real bench.json (train, weak scaling, measured at 1-4 CPU ranks, predicted at 3 and 4 from 1 and
2 on this host's loopback), its runs' summaries trimmed to what the prediction reads."""

from __future__ import annotations

import copy
import html
import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

FIXTURE = Path(__file__).parent / "data" / "bench_predict_train.json"


@pytest.fixture
def bench() -> dict:
    return json.loads(FIXTURE.read_text())


def _lines(ax) -> dict:
    return {line.get_label(): line for line in ax.get_lines()}


def _bar_labels(ax) -> list[str]:
    return [c.get_label() for c in ax.containers]


def _wide(bench: dict, link=None) -> dict:
    """The fixture measured at 1 and 2 ranks only, predicted at 8, 64 and 512."""
    from multigpu.bench.predict import Link, predict

    runs = [r for r in bench["runs"] if r["world_size"] <= 2]
    wide = dict(bench, runs=runs, rows=[r for r in bench["rows"] if r["world_size"] <= 2])
    wide["prediction"] = predict(runs, (8, 64, 512), link or Link(**bench["prediction"]["link"]),
                                 scaling=bench["scaling"], cores=2, cpu_ranks=True, threads=1)
    return wide


def test_the_predicted_speedup_is_drawn_beside_the_measured_one(bench):
    from multigpu.report.plots import bench_figure

    pred = bench["prediction"]
    fig = bench_figure(bench)
    speedup, split = fig.axes[:2]
    lines = _lines(speedup)
    predicted = lines["predicted (this host's gloo over loopback, fitted on N = 1, 2)"]
    assert list(predicted.get_xdata()) == [3, 4]
    assert list(predicted.get_ydata()) == [r["speedup"] for r in pred["rows"]]
    assert predicted.get_linestyle() == "--" and predicted.get_markerfacecolor() == "white"  # hollow, dashed
    # the measured points at the same sizes stay drawn, and how far off the prediction was is written beside it
    assert list(lines["measured (median)"].get_xdata()) == [1, 2, 3, 4]
    assert list(lines["ideal"].get_xdata()) == [1, 2, 3, 4]
    assert [t.get_text() for t in speedup.texts] == ["step -6%\nvs measured", "step -4%\nvs measured"]
    assert speedup.get_xscale() == "linear" and list(speedup.get_xticks()) == [1, 2, 3, 4]
    # the step split: a measured and a predicted bar at 3 and 4, the predicted one in the model's parts
    ticks = [t.get_text() for t in split.get_xticklabels()]
    assert ticks == ["1", "2", "3", "3\npredicted", "4", "4\npredicted"]
    assert _bar_labels(split) == ["compute", "communication", "predicted compute", "predicted imbalance",
                                  "predicted latency", "predicted bandwidth"]
    tops = {}
    for container in split.containers:
        for patch in container:
            x = round(patch.get_x() + patch.get_width() / 2)
            tops[x] = max(tops.get(x, 0.0), patch.get_y() + patch.get_height())
    assert tops[3] == pytest.approx(pred["rows"][0]["step_time_s"] * 1000)  # ms, stacked to the predicted step
    assert split.get_ylabel() == "median step time (ms)"
    # on each predicted bar of a size also measured: the measured mean step the error is against
    mark = _lines(split)["measured mean step"]
    assert list(mark.get_ydata()) == [pred["rows"][0]["measured_step_time_s"] * 1000] * 2
    assert mark.get_xdata()[0] < 3 < mark.get_xdata()[1]
    assert len([line for line in split.get_lines() if line.get_color() == "black"]) == 2  # at 3 and at 4
    caption = fig.get_supxlabel()
    assert "this host's gloo over loopback" in caption and "fitted on the measured N = 1, 2" in caption


def test_a_wide_range_of_sizes_gets_log2_axes_and_shares(bench):
    from multigpu.report.plots import bench_figure

    wide = _wide(bench)
    fig = bench_figure(wide)
    speedup, split = fig.axes[:2]
    assert speedup.get_xscale() == "log" and speedup.get_yscale() == "log"
    assert list(speedup.get_xticks()) == [1, 2, 8, 64, 512]
    assert [t.get_text() for t in speedup.get_xticklabels()] == ["1", "2", "8", "64", "512"]
    predicted = next(line for line in speedup.get_lines() if line.get_label().startswith("predicted"))
    assert list(predicted.get_xdata()) == [8, 64, 512]
    assert not speedup.texts  # no predicted size was measured: no error to write
    # the predicted steps (the ranks crowd this host's 2 cores) span far more than 16x: the bars show shares
    assert split.get_ylabel() == "share of the step (%)"
    totals: dict[int, float] = {}
    for container in split.containers:
        for patch in container:
            x = round(patch.get_x() + patch.get_width() / 2)
            totals[x] = totals.get(x, 0.0) + patch.get_height()
    assert list(totals.values()) == pytest.approx([100.0] * 5)
    steps = [r["step_time_s"] for r in wide["prediction"]["rows"]]
    assert [t.get_text().split("\n")[0] for t in split.texts][2:] == [f"{s:.3g} s" for s in steps]


def test_without_a_prediction_the_figure_is_the_measured_one(bench):
    from multigpu.report.plots import bench_figure

    del bench["prediction"]  # a bench.json from before --predict, or a bench without it
    fig = bench_figure(bench)
    speedup, split = fig.axes[:2]
    assert list(_lines(speedup)) == ["ideal", "measured (median)", "min"]
    assert _bar_labels(split) == ["compute", "communication"] and not fig.get_supxlabel()


def test_other_step_parts_a_newer_model_adds_are_drawn_and_listed(bench, tmp_path):
    from multigpu.report import build_report
    from multigpu.report.plots import bench_figure, pred_parts

    for r in bench["prediction"]["rows"]:
        r["cpu_bound_s"] = 0.05
        r["note_s"] = "not a number"  # ignored, as is any field not a number of seconds
        r["flag_s"] = True
    assert pred_parts(bench["prediction"]["rows"]) == ["compute", "imbalance", "latency", "bandwidth", "cpu_bound"]
    assert "predicted cpu_bound" in _bar_labels(bench_figure(bench).axes[1])
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    page = build_report(tmp_path)
    assert "<th>cpu_bound ms</th>" in page and "<td class=num>50.00</td>" in page


def test_the_report_lists_the_predicted_rows_interconnect_and_assumptions(bench, tmp_path):
    from multigpu.report import build_report

    pred = bench["prediction"]
    pred["assumptions"] = [*pred["assumptions"], "a <b>made-up</b> assumption & more"]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    page = build_report(tmp_path)
    section = page[page.index("<h3>Predicted scaling</h3>"):]
    assert "fitted on the measured world size(s) 1, 2" in section
    assert "<b>this host&#x27;s gloo over loopback</b>, latency 102 us and 4.55 GB/s" in section
    assert "(measured by a ping-pong sweep, gloo)" in section
    assert "ping-pong one-way times it was measured from: 8 B 102 us, 1,024 B 116 us," in section
    assert "1,048,576 B 1.31 ms, 4,194,304 B 2 ms</p>" in section
    header = ["ranks", "step ms", "speedup", "efficiency", "compute ms", "imbalance ms", "latency ms",
              "bandwidth ms", "bottleneck", "measured step ms", "error"]
    assert "<tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>" in section
    three = ["3", "600.61", "2.06x", "69%", "581.58", "16.50", "0.41", "2.13", "compute", "638.23", "-6%"]
    assert "<tr><td>3</td>" + "".join(f"<td class=num>{c}</td>" for c in three[1:]) + "</tr>" in section
    for line in [*pred["assumptions"], *pred["cannot_know"]]:
        assert f"<li>{html.escape(line)}</li>" in section
    assert "a &lt;b&gt;made-up&lt;/b&gt; assumption &amp; more" in section and "<b>made-up" not in section
    assert "What the prediction cannot know" in section


def test_a_report_without_a_prediction_has_no_predicted_section(bench, tmp_path):
    from multigpu.report import build_report

    old = copy.deepcopy(bench)
    del old["prediction"]
    (tmp_path / "bench.json").write_text(json.dumps(old))
    page = build_report(tmp_path)
    assert "Scaling (weak)" in page and "Predicted scaling" not in page


def test_an_hsdp_prediction_shows_its_layout_in_the_report_and_the_printed_table(tmp_path):
    """A real bench.json of `train strategy=hsdp hsdp_shard_size=2` (2 and 4 CPU ranks, predicted at 4)."""
    import io

    from rich.console import Console

    from multigpu.cli.bench import print_prediction
    from multigpu.report import build_report

    bench = json.loads((Path(__file__).parent / "data" / "bench_predict_hsdp.json").read_text())
    assert bench["prediction"]["rows"][0]["hsdp"] == [2, 2]
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    section = build_report(tmp_path)
    assert "<tr><td>4 (2 x 2)</td>" in section[section.index("<h3>Predicted scaling</h3>"):]
    out = io.StringIO()
    print_prediction(bench["prediction"], Console(file=out, width=200))
    assert "│ 4 (2 x 2) │" in out.getvalue()
    assert "hsdp: each replica is sharded over hsdp_shard_size=2, as the job sets it" in out.getvalue()


def test_a_prediction_fitted_on_runs_the_bench_distrusts_is_printed_struck_out_and_not_drawn(bench, tmp_path, capsys):
    """`bench --predict` printed "64: 84.80x 132%" from a fit the bench itself called NOISY."""
    import argparse

    from multigpu.cli.bench import add_prediction
    from multigpu.launch.config import LaunchConfig

    bench["rows"][1]["doubts"] = ["its rate moved 3.0x during the run"]
    bench["plot"] = "bench.png"
    args = argparse.Namespace(predict="8,64", interconnect="ib-ndr", alpha_us=None, bandwidth_gbs=None,
                              ranks_per_node=None, node_interconnect=None)
    add_prediction(args, bench, tmp_path, LaunchConfig(cpu=True))
    pred = json.loads((tmp_path / "bench.json").read_text())["prediction"]
    assert pred["distrusted"] == ["2 ranks: its rate moved 3.0x during the run"]
    assert not (tmp_path / "bench.png").exists()  # not drawn as if it were a prediction
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "NOT A PREDICTION, its runs are not trusted" in out
    assert ("not a prediction: the runs it is fitted on cannot be trusted (2 ranks: its rate moved 3.0x during "
            "the run). Rerun with --repeat 3") in out
    page = __import__("multigpu.report.html", fromlist=["x"])._prediction_section(pred)
    assert "Not a prediction: the runs it is fitted on cannot be trusted" in page


def test_a_script_timed_by_its_wall_clock_is_drawn_as_the_whole_run_not_as_compute():
    """bench.png labelled a wall-clock-timed script's whole run as "compute" step time."""
    from multigpu.bench.table import scaling_rows
    from multigpu.report.plots import bench_figure
    from tests.unit.test_bench_table import _wall_run

    rows = scaling_rows([_wall_run(1, 2.0), _wall_run(2, 1.2)])
    fig = bench_figure({"rows": rows, "scaling": "strong"})
    split = fig.axes[1]
    assert _bar_labels(split) == ["whole run, wall clock (not split)"]
    assert split.get_ylabel() == "run time, wall clock (ms)" and "not split" in split.get_title()
