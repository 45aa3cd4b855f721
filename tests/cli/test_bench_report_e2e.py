"""`multigpu bench` on the example at 1 and 2 CPU ranks, then `multigpu report`, rendered in headless Chromium.

One bench run (two launches) is shared by every test here: it is the expensive part.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.e2e
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def bench_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "b"
    proc = run_cli("bench", "--nproc", "1,2", "--sample-interval-s", "0.2", "-o", str(out), "examples/allreduce_dp.py", "--steps", "12",
                   env={"COLUMNS": "200"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stdout


def test_bench_prints_the_measured_table_and_writes_json_and_plot(bench_dir):
    out, stdout = bench_dir
    assert "multigpu bench: strong scaling" in stdout
    for column in ("samples/s (median)", "speedup", "efficiency", "comm share", "imbalance"):
        assert column in stdout
    result = json.loads((out / "bench.json").read_text())
    one, two = result["rows"]
    assert (one["world_size"], two["world_size"]) == (1, 2) and one["speedup"] == 1.0
    assert two["speedup"] == pytest.approx(two["throughput_median"] / one["throughput_median"])
    assert one["comm_share"] == 0.0 and 0 < two["comm_share"] < 1  # the all-reduce, measured
    assert two["imbalance"] >= 1.0 and two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert result["notes"] and result["notes"][0][:30] in stdout  # the verdict is printed under the table
    assert (out / "bench.png").stat().st_size > 10_000
    summary = json.loads((out / "np2_r0" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 11 and summary["final_loss"] > 0
    # the node's sampler (on local rank 0) followed both ranks of the 2-rank run
    samples = [json.loads(x) for x in (out / "np2_r0" / "samples_node0.jsonl").read_text().splitlines()]
    assert {r["rank"] for s in samples for r in s["ranks"]} == {0, 1}


def test_bench_shows_where_start_up_went_at_each_world_size(bench_dir):
    """From the command to the first step, in parts: the launcher's own start (the first launch of the process:
    from its start), torch's agent, the workers' start with their torch import, the group, the set-up."""
    out, stdout = bench_dir
    assert "start-up: from the command to the first step" in stdout and "torch import" in stdout
    one, two = json.loads((out / "bench.json").read_text())["startup"]
    assert list(two["parts_s"]) == ["launcher", "rendezvous", "worker start", "to process group", "set-up"]
    # a script launched at one rank gets torch's default group of one (as under torchrun): joined too
    assert list(one["parts_s"]) == list(two["parts_s"])
    for row in (one, two):
        assert all(v >= 0 for v in row["parts_s"].values()) and row["first_step_s"] > 0
        assert row["to_first_step_s"] == pytest.approx(sum(row["parts_s"].values()), abs=1e-6)
        assert 0 < row["torch_import_s"] < row["parts_s"]["worker start"] + row["parts_s"]["launcher"]
    assert one["parts_s"]["launcher"] > two["parts_s"]["launcher"]  # the 2-rank run: bench's own second launch


def test_bench_rejects_bad_input_before_running_anything(tmp_path, capsys):
    from multigpu.cli import main

    out = tmp_path / "never"
    for args, words in [
        (["--nproc", "1,x", "-o", str(out), "examples/allreduce_dp.py"], "--nproc '1,x' is invalid"),
        (["--nproc", "1,2", "-o", str(out), "trian"], "unknown workload 'trian'"),
        (["--nproc", "1,2", "--nproc-per-node", "2", "-o", str(out), "examples/allreduce_dp.py"], "use --nproc"),
    ]:
        code = main(["bench", *args])  # in-process: nothing may launch before the input is checked
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, err
    assert not out.exists()


def _chromium(*flags: str, page: Path, profile: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
         "--enable-logging=stderr", "--v=0", *flags, page.as_uri()],
        capture_output=True, text=True, timeout=90,
    )


def test_report_renders_in_headless_chromium_with_its_plots_and_no_console_errors(bench_dir, tmp_path):
    if not CHROMIUM.is_file():
        pytest.skip("/usr/bin/chromium is absent (Debian: apt-get install chromium; .ci/run installs it)")
    Image = pytest.importorskip("PIL.Image")

    out, _ = bench_dir
    page = tmp_path / "report.html"
    proc = run_cli("report", str(out), "-o", str(page), timeout=120)
    assert proc.returncode == 0 and str(page) in proc.stdout, proc.stderr
    html = page.read_text()
    assert "Scaling (strong)" in html and "np2_r0" in html and "Start-up: from the command to the first step" in html

    dom = _chromium("--dump-dom", page=page, profile=tmp_path / "profile1")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-images="5/5"' in dom.stdout  # every embedded plot decoded (set by the page's load handler)
    assert [ln for ln in dom.stderr.splitlines() if ":CONSOLE" in ln] == []

    shot = tmp_path / "report.png"
    run = _chromium("--window-size=1200,2400", "--hide-scrollbars", f"--screenshot={shot}", page=page,
                    profile=tmp_path / "profile2")
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    assert [ln for ln in run.stderr.splitlines() if ":CONSOLE" in ln] == []
    image = Image.open(shot).convert("RGB")
    assert image.size == (1200, 2400)
    colours = image.getcolors(maxcolors=1_000_000)
    assert colours is not None and len(colours) > 200  # text, tables and plots, not a blank page

    # negative control: the same check notices a plot that does not decode
    broken = tmp_path / "broken.html"
    broken.write_text(html.replace("data:image/png;base64,iVBOR", "data:image/png;base64,AAAA", 1))
    dom = _chromium("--dump-dom", page=broken, profile=tmp_path / "profile3")
    assert 'data-images="4/5"' in dom.stdout
