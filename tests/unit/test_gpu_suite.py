"""The GPU suite as one bounded device call, checked where there is no GPU.

run_all.sh cannot run here: these parse its time budget, run it to see it stop cleanly without a GPU, and
render a small hand-made results file (collect.py's layout, tests/unit/data/gpu_results_small.json; not
figures from a GPU) into the GPU blocks of RESULTS.md and the README.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.conftest import ROOT

GPU = ROOT / "benchmarks" / "gpu"
SCRIPT = GPU / "run_all.sh"
FIXTURE = ROOT / "tests" / "unit" / "data" / "gpu_results_small.json"
ONE_CALL_S = 585  # one device command, with 15 s to spare under its 10-minute limit


def _defaults() -> dict[str, int]:
    text = SCRIPT.read_text()
    out = {k: int(v) for k, v in re.findall(r"^(\w+_S)=\$\{\1:-(\d+)\}", text, flags=re.M)}
    out.update({k: int(v) for k, v in re.findall(r"^(CALL_S|KILL_S|BOUNDED)=(\d+)\b", text, flags=re.M)})
    return out


def test_the_time_budgets_add_up_to_one_call():
    d = _defaults()
    text = SCRIPT.read_text()
    steps = re.findall(r'^(?:bench|tests)_step (\w+)\s+"\$(\w+_S)"', text, flags=re.M)
    assert [name for name, _ in steps] == ["smoke", "tests_launch", "tests_train", "tests_work", "train", "sim",
                                           "infer", "envs", "ppo", "checkpoint", "doctor"]
    assert all(cap in d for _, cap in steps)  # every step runs under a cap defined (and added up) here
    bounded = len(steps) + len(re.findall(r"^timeout --kill-after=\$KILL_S", text, flags=re.M))
    assert d["BOUNDED"] == bounded == 12 and "timeout --kill-after=$KILL_S \"$limit\"" in text
    total = d["SETUP_S"] + sum(d[cap] for _, cap in steps) + d["RENDER_S"] + d["KILL_S"] * d["BOUNDED"]
    assert total <= d["CALL_S"] <= ONE_CALL_S, (total, d)
    # and whatever the caps are set to, the steps stop at BUDGET_S: no step starts a limit past it
    assert "BUDGET_S=$(( CALL_S - RENDER_S - KILL_S ))" in text and "local left=$(( $(remaining) - KILL_S ))" in text


def test_without_a_gpu_it_stops_at_once_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=90, env=env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("run_all.sh: no GPU") and proc.stdout == ""
    assert not out.exists()


def test_rendering_the_gpu_blocks_from_a_recorded_json(tmp_path):
    results, readme = tmp_path / "RESULTS.md", tmp_path / "README.md"
    results.write_text("# Results\n\ntyped notes\n")
    readme.write_text("| cpu | rows |\n\n<!-- gpu-rows:begin -->\nGPU rows: none yet.\n<!-- gpu-rows:end -->\n\n## Next\n")
    cmd = [sys.executable, str(GPU / "render_gpu.py"), str(FIXTURE), "--md", str(tmp_path / "gpu.md"),
           "--results", str(results), "--readme", str(readme)]
    for _ in range(2):  # a second render replaces the block, it does not add one
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    md, rows = results.read_text(), readme.read_text()
    assert md.startswith("# Results\n\ntyped notes\n") and md.count("<!-- gpu:begin -->") == 1
    assert "Machine: NVIDIA H100 80GB HBM3 × 1, driver 570.86.15, torch 2.13.0+cu128" in md
    assert "| train | GPT-2 124M training tokens/s vs nanoGPT's bench.py loop (bf16, compile) | ok | 112 | " \
           "tokens/s: ours 1.02x nanoGPT's loop (above 1: ours faster) |" in md
    assert "| tests | GPU tests (`pytest -m gpu tests/gpu`) | failed | 131 | 25 passed, 1 failed, 4 skipped |" in md
    assert "| sim | SIR agent-steps/s on CUDA vs the same engine on the CPU | timeout (no record written) | 65 | — |" in md
    assert "| envs: faster than gymnasium on every core | — |" in md  # not measured is never "false" or 0
    assert "- failed: `tests.gpu.test_nccl_gpu::test_two_gpus`: assert 1 == 2" in md
    assert "ours: tokens_per_s=410,000, mfu=0.43" in md and "| 1,048,576 | 2,100,000,000 |" in md
    assert rows.startswith("| cpu | rows |\n\n<!-- gpu-rows:begin -->\nGPU rows, from `bash benchmarks/gpu/run_all.sh`")
    assert rows.endswith("<!-- gpu-rows:end -->\n\n## Next\n") and rows.count("<!-- gpu-rows:begin -->") == 1
    assert "| GPT-2 124M training tokens/s vs nanoGPT's bench.py loop (bf16, compile) | ok | tokens/s: ours 1.02x " \
           "nanoGPT's loop (above 1: ours faster) | mfu >= 0.40: met; ratio >= 1.0: met |" in rows
    assert "doctor" not in rows.split("gpu-rows:begin")[1]  # a skipped step is no row
    assert (tmp_path / "gpu.md").read_text() in md


def test_a_run_with_no_step_leaves_the_placeholder(tmp_path):
    sys.path.insert(0, str(GPU))
    try:
        import render_gpu
    finally:
        sys.path.pop(0)
    assert render_gpu.readme_rows({"machine": None, "steps": {}}).startswith("GPU rows: none yet")


def test_a_rows_status_matches_its_counts_and_each_ratio_names_its_peer_and_direction():
    """The README read "ours / peer 1" (which peer? which way is better?) and a row "failed" beside "12 passed, 0
    failed" (the chunk's process exited 1 after every test passed). Each ratio now names what it divides and which
    way is faster; a tests row whose tests all passed but whose run failed says so in its status."""
    sys.path.insert(0, str(GPU))
    try:
        import render_gpu
    finally:
        sys.path.pop(0)
    counts = {"tests": 12, "failures": 0, "errors": 0, "skipped": 0, "passed": 12}
    data = {"machine": {"gpu": "NVIDIA H200"}, "started": "now", "targets": {}, "steps": {
        "tests_work": {"status": "failed", "rc": 1, "tests": counts},
        "tests_train": {"status": "ok", "rc": 0, "tests": counts},
        "infer": {"status": "ok", "rc": 0, "record": {"ratio": 0.655}},
        "envs": {"status": "ok", "rc": 0, "record": {"ratio": 4.44}},
        "sim": {"status": "ok", "rc": 0, "record": {"ratio": 3.5}}}}
    rows = render_gpu.readme_rows(data)
    assert ("| GPU tests: sim, infer, envs, monitor and doctor | failed: exit code 1 after every test passed | "
            "12 passed, 0 failed, 0 skipped |") in rows, rows
    assert "| GPU tests: training, timing, NCCL, devices | ok | 12 passed, 0 failed, 0 skipped |" in rows
    assert "| speed: ours 0.655x MONAI (above 1: ours faster) |" in rows, rows
    assert "| env-steps/s: ours 4.44x gymnasium (above 1: ours faster) |" in rows, rows
    assert "| agent-steps/s: CUDA 3.50x the same engine on the CPU (above 1: the GPU faster) |" in rows, rows
    assert "ours / peer" not in rows


def _junit(path, passed: int, failed: int = 0):
    cases = "".join(f'<testcase classname="tests.gpu.t" name="p{i}"/>' for i in range(passed))
    cases += "".join(f'<testcase classname="tests.gpu.t" name="f{i}"><failure message="boom">x</failure></testcase>'
                     for i in range(failed))
    path.write_text(f'<testsuites><testsuite tests="{passed + failed}" failures="{failed}" errors="0" skipped="0">'
                    f"{cases}</testsuite></testsuites>")
    return path


def _collect(results, *args, env=None):
    subprocess.run([sys.executable, str(GPU / "collect.py"), str(results), *map(str, args)], check=True,
                   capture_output=True, timeout=60, env={**os.environ, **(env or {})})


def _render(results, tmp_path) -> tuple[str, str]:
    md, readme = tmp_path / "gpu.md", tmp_path / "README.md"
    readme.write_text("<!-- gpu-rows:begin -->\n<!-- gpu-rows:end -->\n")
    subprocess.run([sys.executable, str(GPU / "render_gpu.py"), str(results), "--md", str(md), "--readme", str(readme)],
                   check=True, capture_output=True, timeout=60)
    return md.read_text(), readme.read_text()


def _machine(results, started: str) -> None:
    """A results file as collect.py --meta starts it on an H200 (without importing torch here)."""
    results.write_text(json.dumps({"started": started, "machine": {"gpu": "NVIDIA H200", "gpu_count": 1,
                                                                   "torch": "2.11.0+cu130"},
                                   "source": {"commit": "ab" * 20, "text": "abababababab"}, "steps": {},
                                   "targets": {}}))


def test_a_rows_status_matches_its_counts_and_a_missing_peer_is_said(tmp_path):
    """The first GPU calls: a chunk read "failed" beside "12 passed, 0 failed" (pytest exited 1 after every test
    passed: the session's own check of processes left behind), and without fetch_wheels.sh first MONAI and
    gymnasium were skipped silently (the ratio "—", the row "ok"). Now the status says what the counts say, and a
    missing peer is said in the row."""
    results = tmp_path / "r.json"
    _machine(results, "2026-11-28T10:00:00+0000")
    _collect(results, "--step", "tests_work", "--status", "failed", "--rc", "1", "--seconds", "66",
             "--junit", _junit(tmp_path / "ok.xml", 12))
    _collect(results, "--step", "tests_train", "--status", "failed", "--rc", "1", "--seconds", "50",
             "--junit", _junit(tmp_path / "bad.xml", 11, 1))
    record = tmp_path / "infer.json"
    record.write_text(json.dumps({"benchmark": "infer_gpu", "summary": "1,501 windows/s", "ratio": None,
                                  "peer_missing": "MONAI is not installed (No module named 'monai')",
                                  "targets": {"ratio >= 1.0": None}}))
    _collect(results, "--step", "infer", "--status", "ok", "--rc", "0", "--seconds", "22", "--record", record)
    steps = json.loads(results.read_text())["steps"]
    assert steps["tests_work"]["status"] == "rc 1, no test failed" and steps["tests_train"]["status"] == "failed"
    assert steps["infer"]["status"] == "peer missing"
    md, rows = _render(results, tmp_path)
    assert "| rc 1, no test failed | 12 passed, 0 failed, 0 skipped |" in rows
    assert "| failed | 11 passed, 1 failed, 0 skipped |" in rows
    assert "| peer missing | ours only (1,501 windows/s); **PEER MISSING**: MONAI is not installed" in rows
    assert "| ratio >= 1.0: — |" in rows and "| failed | 12 passed" not in md + rows


def test_rows_from_two_calls_name_the_call_each_came_from(tmp_path):
    """The README's rows once mixed two calls under one date. Merged calls (collect.py --merge: each step from the
    last call that ran it) name their calls in the header and each row's call in a column; one call's rows say it
    is one call and its source."""
    first, second, merged = tmp_path / "call1.json", tmp_path / "call2.json", tmp_path / "merged.json"
    _machine(first, "2026-11-27T00:23:47+0000")
    _collect(first, "--step", "smoke", "--status", "ok", "--rc", "0", "--seconds", "11")
    _collect(first, "--step", "sim", "--status", "timeout", "--rc", "124", "--seconds", "55")
    md, rows = _render(first, tmp_path)
    assert "(one device call, started 2026-11-27T00:23:47+0000, source abababababab; details" in rows
    assert " call |" not in rows
    _machine(second, "2026-11-27T00:38:46+0000")
    _collect(second, "--step", "smoke", "--status", "skipped", "--note", "out of time")
    _collect(second, "--step", "sim", "--status", "ok", "--rc", "0", "--seconds", "40")
    _collect(merged, "--merge", first, second)
    data = json.loads(merged.read_text())
    assert data["steps"]["smoke"]["status"] == "ok" and data["steps"]["sim"]["status"] == "ok"  # a skip keeps a run
    md, rows = _render(merged, tmp_path)
    assert "2 device calls (started 2026-11-27T00:23:47+0000, 2026-11-27T00:38:46+0000" in rows
    assert "| ok | — | — | 2026-11-27T00:23:47+0000 |" in rows  # smoke, from call 1
    assert "| ok | — | — | 2026-11-27T00:38:46+0000 |" in rows  # sim, from call 2
    assert "| call |" in md


def test_every_step_records_its_source_gpu_and_start(tmp_path):
    results = tmp_path / "r.json"
    _machine(results, "2026-11-28T10:00:00+0000")
    _collect(results, "--step", "train", "--status", "ok", "--rc", "0", "--seconds", "65",
             "--started", "2026-11-28T10:01:02+0000")
    step = json.loads(results.read_text())["steps"]["train"]
    assert step["commit"] == "abababababab" and step["gpu"] == "NVIDIA H200" and step["torch"]
    assert step["started"] == "2026-11-28T10:01:02+0000" and step["call"] == "2026-11-28T10:00:00+0000"


def test_the_source_of_a_copy_without_git_is_the_file_written_before_the_call(tmp_path):
    """The device machine's copy of the working tree may have no .git: fetch_wheels.sh writes .whl/source.json
    (HEAD and its files' blobs) where git is, and the call hashes each file again, so a copy that is not that
    commit says which files differ; with neither, the source is "unknown", never a guess."""
    written = tmp_path / "source.json"
    subprocess.run([sys.executable, str(GPU / "source.py"), "--write", str(written)], check=True, capture_output=True,
                   timeout=60)
    here = json.loads(subprocess.run([sys.executable, str(GPU / "source.py")], check=True, capture_output=True,
                                     text=True, timeout=60).stdout)
    assert here["how"] == "git" and len(here["commit"]) == 40
    copy = tmp_path / "copy"
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True, capture_output=True,
                             text=True).stdout.split("\0")
    for name in filter(None, tracked):
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            (copy / name).write_bytes((ROOT / name).read_bytes())
    (copy / "benchmarks" / "gpu" / "source.py").write_bytes((GPU / "source.py").read_bytes())
    (copy / "README.md").write_text("changed on the way\n")
    out = json.loads(subprocess.run([sys.executable, str(copy / "benchmarks" / "gpu" / "source.py"), "--from",
                                     str(written)], check=True, capture_output=True, text=True, timeout=60,
                                    cwd=tmp_path).stdout)
    # the commit, and the files that differ from it: those this checkout changed since HEAD, and README.md
    assert out["commit"] == here["commit"] and out["how"].startswith("source.json written")
    assert out["changed_count"] == len({*here["changed"], "README.md"}) and "README.md" in out["changed"]
    assert out["text"].startswith(here["commit"][:12] + " + ")
    none = json.loads(subprocess.run([sys.executable, str(copy / "benchmarks" / "gpu" / "source.py"), "--from",
                                      str(tmp_path / "absent.json")], check=True, capture_output=True, text=True,
                                     timeout=60, cwd=tmp_path).stdout)
    assert none["commit"] is None and none["text"].startswith("unknown: no .git here")
    assert "fetch_wheels.sh" in none["text"]
