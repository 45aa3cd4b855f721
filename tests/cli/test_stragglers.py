"""A rank persistently slower than the others is named: which rank and node, by how much, since which step.

Before, a straggler showed only as a load imbalance figure in summary.json (which rank, and since when, nowhere),
and `multigpu report` and `multigpu bench` did not say it either. One real launch (two gloo ranks, rank 1 slowed
from step 4 by a test-only fault, as a slower device or a throttled core would) feeds every check: the run's log,
summary.json, the report and bench's table. The pure detection is pinned without processes.
"""

from __future__ import annotations

import io
import json
import socket

import pytest

from multigpu.monitor.stragglers import StragglerWatch, find
from tests.conftest import ROOT, run_cli

TINY = ["batch_size=4", "eval_every=0", "eval_batches=1", "model.kwargs.n_layer=1", "model.kwargs.n_head=2",
        "model.kwargs.n_embd=16", "block_size=16", "data.kwargs.max_chars=20000", "sample_chars=0", "prefetch=0",
        "checkpoint_every=0", "logger=[]"]


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """A 16-step training run whose rank 1 computes 0.15 s longer per step from step 4 on."""
    folder = tmp_path_factory.mktemp("slowed")
    (folder / "slow_here.py").write_text(
        "from multigpu.testing.faults import SlowRank\n\n\ndef hook():\n    return SlowRank(rank=1, step=4, seconds=0.15)\n")
    import os

    env = {"PYTHONPATH": os.pathsep.join([str(folder), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = run_cli("train", "-f", "nano", "--cpu", "--nproc-per-node", "2", "--run-dir", str(folder / "run"), *TINY,
                   "steps=16", "log_every=2", "callbacks=[slow_here:hook]", env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder / "run", proc


@pytest.mark.e2e
@pytest.mark.fault
def test_a_slowed_rank_is_named_in_the_log_the_summary_the_report_and_bench(slowed, capsys):
    run, proc = slowed
    host = socket.gethostname()
    named = [line for line in proc.stdout.splitlines() if line.startswith("multigpu: straggler: ")]
    assert len(named) == 1, proc.stdout[-3000:]  # once, during the run (at a log point)
    assert named[0].startswith(f"multigpu: straggler: rank 1 (node 0, {host}) is ") and " slower than the other ranks" \
        in named[0], named
    assert proc.stdout.index(named[0]) < proc.stdout.index("step 16/16")  # before the end, as it happened
    summary = json.loads((run / "summary.json").read_text())
    [s] = summary["stragglers"]
    assert (s["rank"], s["node"], s["host"]) == (1, 0, host)
    # from the step the fault began (one earlier where that step happened to be slow too on a busy machine)
    assert 3 <= s["since_step"] <= 4 and s["last_step"] == 16, s
    assert s["slowdown"] > 1.5 and s["busy_s"] - s["others_busy_s"] > 0.1, s

    from multigpu.cli import main

    assert main(["report", str(run), "-o", str(run / "r.html")]) == 0
    page = (run / "r.html").read_text()
    assert f"<b>straggler:</b> rank 1 (node 0, {host}) is {s['slowdown']:.2f}x slower" in page
    assert f"since step {s['since_step']}" in page

    from rich.console import Console

    from multigpu.bench.table import explain, scaling_rows
    from multigpu.cli.bench import print_table

    base = {**summary, "world_size": 1, "stragglers": [], "throughput": summary["throughput"] / 1.5}
    rows = scaling_rows([{"world_size": 1, "summary": base}, {"world_size": 2, "summary": summary}])
    out = io.StringIO()
    print_table({"rows": rows, "notes": explain(rows, cores=2), "unit": "tokens"},
                Console(file=out, width=400))
    assert f"STRAGGLER: at 2 ranks, rank 1 (node 0, {host}) is {s['slowdown']:.2f}x slower" in out.getvalue()


def test_only_a_persistent_slowdown_is_named_with_its_first_step():
    """The detection alone: a one-step hiccup is not named; a rank slow from step 6 on is, once, since step 6; a
    rank whose communication time was not measured is not judged (None, never 'none')."""
    busy = [[0.01] * 30, [0.01] * 30, [0.01] * 30]
    busy[2][3] = 0.5  # a hiccup
    busy[0][2:9] = [0.03] * 7  # 3x for 7 steps: another process held its core for a while
    busy[2][12:29] = [0.014] * 17  # 1.4x: not slow enough
    for step in range(15, 30):
        busy[1][step] = 0.03
    [s] = find(busy, nodes=[0, 0, 1], hosts=["a", "a", "b"])
    assert (s["rank"], s["node"], s["host"], s["since_step"], s["last_step"]) == (1, 0, "a", 16, 30)
    assert s["slowdown"] == pytest.approx(15 * 0.03 / (14 * 0.012 + 0.01))  # over the streak, against the median
    assert find([[0.01] * 5, None]) is None
    assert find([[0.001] * 30, [0.004] * 30]) == []  # 4x, but 3 ms a step: noise, and it costs the job little
    watch = StragglerWatch(2)
    said = [watch.feed(step, step, [0.01, 0.05]) for step in range(1, 13)]
    assert [len(n) for n in said] == [0] * 9 + [1, 0, 0]  # named once, at the tenth slow step in a row
    assert watch.feed(13, 16, [0.05, 0.05]) == [] and watch.stragglers()[0]["last_step"] == 12  # recovered
