"""Where start-up went: the marks of a rank, the job's parts (the last rank reaching each mark), and how bench and
the report show them. Pins that a user sees, per world size, the seconds from the command to the first step in parts
(launcher, rendezvous, worker start, until the process group, set-up) and a worker's ``import torch``."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from multigpu.launch import _worker
from multigpu.monitor import startup


def _rank(offset: float, **extra) -> dict:
    base = {"launcher_start": 100.0, "launcher_ready": 101.0, "worker_start": 101.2 + offset,
            "worker_ready": 102.5 + offset, "group_joined": 103.0 + offset, "first_step": 104.0 + offset,
            "first_step_end": 104.5 + offset, "torch_import_s": 1.1 + offset}
    return {**base, **extra}


def test_the_jobs_start_up_is_cut_at_the_marks_its_last_rank_reached():
    got = startup.job_startup([_rank(0.0), _rank(0.25)])
    assert got["parts_s"] == pytest.approx({"launcher": 1.0, "rendezvous": 0.45, "worker start": 1.3,
                                            "to process group": 0.5, "set-up": 1.0})
    assert got["to_first_step_s"] == pytest.approx(4.25) == pytest.approx(sum(got["parts_s"].values()))
    assert got["first_step_s"] == pytest.approx(0.5) and got["torch_import_s"] == pytest.approx(1.35)


def test_a_missing_mark_merges_its_part_into_the_next_and_no_mark_at_all_is_none():
    no_group = [{k: v for k, v in _rank(0.0).items() if k != "group_joined"}]
    parts = startup.job_startup(no_group)["parts_s"]  # one rank without a process group
    assert "to process group" not in parts and parts["set-up"] == pytest.approx(1.5)
    no_launcher = [{k: v for k, v in _rank(0.0).items() if not k.startswith("launcher")}]
    got = startup.job_startup(no_launcher)  # a restarted group, or a script run without the launcher
    assert list(got["parts_s"]) == ["worker start", "to process group", "set-up"]
    assert got["to_first_step_s"] == pytest.approx(2.8)
    assert startup.job_startup([]) is None and startup.job_startup([{}]) is None


def test_a_rank_reads_the_launchers_marks_and_the_wrappers_unless_its_group_was_restarted(tmp_path):
    run_file = tmp_path / "run.json"
    run_file.write_text(json.dumps({"run": {}, "startup": {"launcher_start": 1.0, "launcher_ready": 2.0}}))
    (tmp_path / "stacks" / startup.STARTUP_DIR).mkdir(parents=True)
    (tmp_path / "stacks" / startup.STARTUP_DIR / "rank1.json").write_text(
        json.dumps({"worker_start": 3.0, "worker_ready": 4.0, "torch_import_s": 0.5}))
    env = {"MULTIGPU_RUN_FILE": str(run_file), "MULTIGPU_STACKS_DIR": str(tmp_path / "stacks"), "RANK": "1"}
    assert startup.rank_marks((5.0, 6.0), env) == {"launcher_start": 1.0, "launcher_ready": 2.0, "worker_start": 3.0,
                                                   "worker_ready": 4.0, "torch_import_s": 0.5, "first_step": 5.0,
                                                   "first_step_end": 6.0}
    restarted = startup.rank_marks(None, {**env, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert "launcher_start" not in restarted and restarted["worker_start"] == 3.0
    assert _worker.STARTUP_DIR == startup.STARTUP_DIR  # the wrapper's copy of the folder's name


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="read from /proc")
def test_a_processs_start_time_is_when_it_began_to_the_kernels_tick():
    before = time.time()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        time.sleep(0.3)
        began = _worker.process_start_time(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert before - 0.05 <= began <= before + 0.25  # not boot time's whole seconds (psutil's create_time)
    assert abs(_worker.process_start_time() - _worker.process_start_time("self")) < 0.05


def test_bench_and_the_report_show_the_start_up_per_world_size(tmp_path):
    pytest.importorskip("matplotlib")
    from multigpu.bench.table import startup_rows
    from multigpu.cli.bench import console, print_startup
    from multigpu.report import write_report
    from tests.unit.test_report import make_bench_dir

    result = make_bench_dir(tmp_path)
    runs = [{**r, "summary": {**r["summary"], "startup": startup.job_startup([_rank(0.1 * i)
                                                                              for i in range(r["world_size"])])}}
            for r in result["runs"]]
    rows = startup_rows(runs)
    assert [r["world_size"] for r in rows] == [1, 2] and rows[1]["to_first_step_s"] == pytest.approx(4.1)
    out = console()
    with out.capture() as seen:
        print_startup(rows, out)
    text = seen.get()
    assert "start-up: from the command to the first step" in text and "rendezvous" in text and "4.10" in text
    (tmp_path / "bench.json").write_text(json.dumps({**result, "startup": rows}, default=str))
    page = write_report(tmp_path).read_text()
    assert "Start-up: from the command to the first step" in page and "start-up parts per world size" in page
