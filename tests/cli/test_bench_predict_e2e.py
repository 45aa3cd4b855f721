"""`multigpu bench --predict`: a real bench of a small script at 1 and 2 CPU ranks, then the predicted table,
its assumptions and what it cannot know, printed, in bench.json and drawn in bench.png."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e


def test_bench_predicts_larger_world_sizes_with_its_assumptions(tmp_path):
    """--alpha-us over the interconnect's own latency: the table's bandwidth stays, the latency is the flag's."""
    out = tmp_path / "b"
    proc = run_cli("bench", "--nproc", "1,2", "--threads", "1", "--predict", "4,8", "--interconnect", "ib-ndr",
                   "--alpha-us", "7.5", "-o", str(out), "examples/allreduce_dp.py", "--steps", "8", "--batch", "256",
                   env={"COLUMNS": "200"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for words in ("predicted (fitted on 1, 2 rank(s); InfiniBand NDR", "bottleneck", "assumptions:",
                  "latency 7.5 us and 50 GB/s per rank and direction (flags)",
                  "the job's own collectives counted at N = 2 (all_reduce", "the prediction cannot know:",
                  "the topology", "congestion"):
        assert words in proc.stdout, proc.stdout
    pred = json.loads((out / "bench.json").read_text())["prediction"]
    assert [r["world_size"] for r in pred["rows"]] == [4, 8] and pred["fit_on"] == [1, 2]
    assert pred["link"]["alpha_s"] == pytest.approx(7.5e-6) and pred["link"]["bandwidth"] == pytest.approx(50e9)
    # each step the example all-reduces its MLP's gradient (256*512 + 512 + 512 + 1 float32) and its loss
    assert pred["traffic"]["all_reduce"] == {"calls": 2, "bytes": (256 * 512 + 512 + 512 + 1) * 4 + 4}
    for row in pred["rows"]:
        assert row["step_time_s"] > 0 and row["bottleneck"] in ("compute", "imbalance", "latency", "bandwidth")
        assert row["efficiency"] == pytest.approx(row["speedup"] / row["world_size"])
    assert pred["assumptions"] and pred["cannot_know"]
    # bench.png was drawn again once the prediction existed: it is the figure of bench.json with the prediction,
    # unless the runs it is fitted on are not trusted (a busy host, a rate that moved: this machine is shared),
    # when it is printed struck out and bench.png stays the measured figure
    pytest.importorskip("matplotlib")
    from multigpu.report.plots import bench_figure, save_png

    bench = json.loads((out / "bench.json").read_text())
    with_it, without = tmp_path / "with.png", tmp_path / "without.png"
    save_png(bench_figure(bench), with_it)
    save_png(bench_figure({k: v for k, v in bench.items() if k != "prediction"}), without)
    drawn = (out / "bench.png").read_bytes()
    distrusted = pred.get("distrusted")
    assert drawn == (without if distrusted else with_it).read_bytes() and with_it.read_bytes() != without.read_bytes()
    assert ("not a prediction: the runs it is fitted on cannot be trusted" in " ".join(proc.stdout.split())) \
        == bool(distrusted)


def test_predict_flags_are_checked_before_anything_runs(tmp_path, capsys):
    from multigpu.cli import main

    out = tmp_path / "never"
    for args, words in [
        (["--predict", "1"], "--predict '1' is invalid; valid: world sizes >= 2"),
        (["--predict", "2,4"], "needs a measured world size below 2"),
        (["--nproc", "1,2", "--interconnect", "ib-ndr"], "describe a prediction; valid: add --predict"),
        (["--predict", "8", "--bandwidth-gbs", "-3"], "--bandwidth-gbs -3.0 is invalid"),
        (["--nproc", "1,2", "--ranks-per-node", "4"], "describe a prediction; valid: add --predict"),
        (["--predict", "8", "--ranks-per-node", "0"], "--ranks-per-node 0 is invalid; valid: a positive whole"),
        (["--predict", "8", "--node-interconnect", "nvlink4"], "--node-interconnect nvlink4 needs a network between "
                                                               "the nodes; valid: --interconnect one of nvlink4"),
    ]:
        nproc = [] if "--nproc" in args else ["--nproc", "2"]
        code = main(["bench", *nproc, *args, "-o", str(out), "examples/allreduce_dp.py"])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert not out.exists()
