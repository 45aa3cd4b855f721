"""The HTML report from a bench folder: self-contained, every section present, bad folders rejected."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from multigpu.bench import BenchConfig, write_bench
from multigpu.errors import ConfigError

pytest.importorskip("matplotlib")


def make_bench_dir(root):
    """A bench folder as `multigpu bench` leaves it, with made-up but well-formed figures."""
    runs = []
    for n, throughput in ((1, 1000.0), (2, 700.0)):
        run_dir = root / f"np{n}_r0"
        run_dir.mkdir(parents=True)
        per_rank = [{"wall_s": 1.0, "comm_s": 0.5 if n > 1 else 0.0, "busy_s": 0.5 if n > 1 else 1.0,
                     "items": 1000 // n, "steps": 10} for _ in range(n)]
        summary = {"unit": "samples", "world_size": n, "steps": 10, "warmup_steps": 1, "items": 1000, "wall_s": 1.0,
                   "throughput": throughput, "step_time_s": {"median": 0.1, "min": 0.09, "max": 0.2},
                   "comm_share": 0.5 if n > 1 else 0.0, "imbalance": 1.1, "per_rank": per_rank}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        (run_dir / "metrics.jsonl").write_text("".join(
            json.dumps({"time": time.time(), "step": s, "steps": 5, "samples_per_s": throughput + s,
                        "step_time_s": 0.1, "comm_share": 0.1}) + "\n" for s in (5, 10)))
        t0 = time.time()
        (run_dir / "samples_node0.jsonl").write_text("".join(json.dumps({
            "time": t0 + i, "node_rank": 0, "host": "h", "cpu_percent": None if i == 0 else 50.0 + i,
            "memory_used_gib": 3.0, "memory_total_gib": 16.0,
            "ranks": [{"rank": r, "local_rank": r, "pid": 100 + r, "cpu_percent": 90.0, "rss_gib": 0.4} for r in range(n)],
            "gpus": [{"index": 0, "name": "G", "util_percent": 40 + i, "memory_used_gib": 1.0, "memory_total_gib": 8.0,
                      "power_w": None, "temperature_c": 50}]}) + "\n" for i in range(3)))
        runs.append({"world_size": n, "repeat": 0, "run_dir": run_dir.name, "summary": summary, "cpu": None})
    from multigpu.report.plots import save_bench_plot

    result = write_bench(root, BenchConfig(nproc=(1, 2)), runs, command=["multigpu", "bench", "--nproc", "1,2", "x.py"])
    save_bench_plot(result, root)  # as the bench command draws it
    return result


def test_report_of_a_bench_folder_is_one_self_contained_page(tmp_path, capsys):
    """Through the command (`multigpu report RUN_DIR`, in-process): the page, and the line naming it."""
    from multigpu.cli import main

    result = make_bench_dir(tmp_path)
    assert result["notes"][0].startswith("SLOWER: 2 ranks ran slower than 1 rank") and (tmp_path / "bench.png").is_file()
    assert main(["report", str(tmp_path)]) == 0
    path = tmp_path / "report.html"
    assert capsys.readouterr().out == f"report: {path}\n"
    page = path.read_text()
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "elsewhere.html")]) == 0
    assert "Scaling (strong)" in (tmp_path / "elsewhere.html").read_text()  # -o: the page goes there
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "elsewhere.html").stat().st_mode & 0o777 == 0o666 & ~umask  # named: the user's umask
    assert path.stat().st_mode & 0o777 == 0o600  # in the run folder: private, as the command writes it
    for section in ("Configuration", "Scaling (strong)", "Throughput over time", "np1_r0", "np2_r0", "SLOWER"):
        assert section in page
    images = re.findall(r'<img alt="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">', page)
    assert len(images) == 4  # scaling, throughput, one utilization figure per run
    assert not re.search(r'(src|href)="(https?:|//|file:)', page)  # nothing loaded from elsewhere


def test_report_of_a_single_run_folder(tmp_path):
    from multigpu.report import build_report

    make_bench_dir(tmp_path)
    (tmp_path / "np2_r0" / "run.json").write_text(json.dumps({"workload": "sim", "config": {"agents": 1000}}))
    page = build_report(tmp_path / "np2_r0")
    assert "Scaling" not in page and "run.json" in page and "&quot;agents&quot;: 1000" in page
    assert page.count("<img ") == 2  # throughput over time, utilization


def test_report_rejects_folders_without_runs(tmp_path):
    from multigpu.report import build_report

    with pytest.raises(ConfigError, match="neither bench.json nor summary.json"):
        build_report(tmp_path)
    with pytest.raises(ConfigError, match="is not a folder"):
        build_report(tmp_path / "missing")


@pytest.mark.parametrize("huge,reason", [(True, "OverflowError"), (False, "nested deeper than Python's JSON reader")])
def test_numbers_too_large_and_json_too_deep_are_one_line(tmp_path, huge, reason):
    """`report` on 10**400 or deeply nested JSON gave `internal error: OverflowError/RecursionError`."""
    from multigpu.report import write_report

    make_bench_dir(tmp_path)
    run = tmp_path / "np2_r0"
    summary = json.loads((run / "summary.json").read_text())
    summary["throughput"] = 10**400
    summary_text = json.dumps(summary) if huge else "[" * 100_000 + "]" * 100_000
    (run / "summary.json").write_text(summary_text)
    (run / "metrics.jsonl").write_text(summary_text + "\n")  # a line too deep is skipped, like a torn one
    with pytest.raises(ConfigError, match=reason) as err:
        write_report(run)
    assert "\n" not in str(err.value) and not (run / "report.html").exists()


def test_names_that_look_like_mathtext_are_shown_as_written(tmp_path, capsys):
    """A run folder named ``$\\macro$`` (or a unit or GPU name like it) made matplotlib parse mathtext and fail; the
    report then blamed metrics.jsonl for a value of the wrong kind. Every text of a figure is shown as written."""
    from multigpu.cli import main

    make_bench_dir(tmp_path)
    run = tmp_path / "np2_r0"
    summary = json.loads((run / "summary.json").read_text())
    summary["unit"] = "$\\unit$"
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(run.joinpath("metrics.jsonl").read_text().replace("samples_per_s",
                                                                                       "$\\\\unit$_per_s"))
    named = run.rename(tmp_path / "$\\macro$ run")
    samples = (named / "samples_node0.jsonl").read_text().replace('"name": "G"', '"name": "$\\\\gpu$"')
    (named / "samples_node0.jsonl").write_text(samples)
    assert main(["report", str(named), "-o", str(tmp_path / "page.html")]) == 0, capsys.readouterr().err
    page = (tmp_path / "page.html").read_text()
    assert page.count("<img ") == 2 and "$\\macro$ run" in page
