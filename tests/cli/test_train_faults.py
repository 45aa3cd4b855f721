"""`multigpu train` survives faults: a SIGKILLed rank is restarted and resumed, Ctrl-C leaves a last checkpoint.

These pin the recovery contracts end to end, with the real launcher
(torchrun's agent) and two gloo ranks:

* rank 1 SIGKILLs itself at a step the test draws at random; with
  ``--max-restarts 1`` the agent restarts the worker group, which resumes from
  the newest valid checkpoint by itself, and the final parameters equal those
  of an uninterrupted run bit for bit;
* SIGINT to the launcher with ``--checkpoint-on-interrupt``: every rank stops
  after the same step, the checkpoint of that step is written and valid, the
  launcher exits 130 within seconds, and no worker process is left;
* SIGTERM (pre-emption, ``timeout``, a scheduler) does the same and exits 143
  (it used to write no checkpoint and exit 1).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from multigpu.checkpoint import CheckpointStore
from tests.conftest import ROOT, fault_callback, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

TINY = ["batch_size=4", "eval_every=0", "eval_batches=1", "log_every=4", "model.kwargs.n_layer=1", "model.kwargs.n_head=2",
        "model.kwargs.n_embd=32", "block_size=32", "data.kwargs.max_chars=60000", "sample_chars=10", "prefetch=0"]
STEPS = 16


def _train(run_dir, *extra, env=None):
    return run_cli("train", "-f", "nano", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                   *TINY, f"steps={STEPS}", "checkpoint_every=3", *extra, env=env, timeout=300)


def _final_model(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "state.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """An uninterrupted run, its checkpoints written synchronously: the final parameters every faulty run ends with."""
    run_dir = tmp_path_factory.mktemp("clean")
    proc = _train(run_dir, "--checkpoint-mode", "sync")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


def _assert_same_end(run_dir, clean, what: str) -> None:
    a, b = _final_model(run_dir), _final_model(clean)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{what}: parameters differ from the uninterrupted run: {different}"


def test_a_rank_killed_at_a_random_step_is_restarted_and_ends_bit_identical(tmp_path, clean, fault_rng):
    kill_at = fault_rng.randint(2, STEPS - 1)  # any step: before, at or after a checkpoint (every 3)
    fault, env = fault_callback(tmp_path, rank=1, step=kill_at)
    faulty = _train(tmp_path / "faulty", "--max-restarts", "1", fault, env=env)
    assert faulty.returncode == 0, f"kill at step {kill_at}:\n{faulty.stderr[-3000:]}"
    last_checkpoint = (kill_at - 1) // 3 * 3  # the kill comes before the checkpoint of its own step
    resumed = f"restart 1: resuming from {tmp_path}/faulty/checkpoints/step_{last_checkpoint:08d}"
    if last_checkpoint:
        assert resumed in faulty.stdout, (kill_at, faulty.stdout)
    else:  # killed before the first checkpoint: the restarted group starts over
        assert "resume=auto" not in faulty.stdout and "restart 1: resuming" not in faulty.stdout
    assert f"done: step {STEPS}" in faulty.stdout
    # the death and the restart are named where they happen and in the run's summary (they used to go unsaid)
    host = socket.gethostname()
    assert (f"multigpu: rank 1 (local rank 1 on node 0, {host}) died (exit code -9): killed by signal SIGKILL; "
            "restarting the worker group (restart 1 of 1)") in faulty.stderr, faulty.stderr[-3000:]
    deaths = json.loads((tmp_path / "faulty" / "summary.json").read_text())["restarts"]
    assert [{k: d[k] for k in ("restart", "rank", "local_rank", "node", "host", "exitcode", "signal")}
            for d in deaths] == [{"restart": 1, "rank": 1, "local_rank": 1, "node": 0, "host": host,
                                  "exitcode": -9, "signal": "SIGKILL"}]
    _assert_same_end(tmp_path / "faulty", clean, f"kill at step {kill_at}")
    steps = [int(line.split('"step": ')[1].split(",")[0])
             for line in (tmp_path / "faulty" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(4, STEPS + 1, 4)), steps  # the killed attempt's records were not doubled


_SLOW_KILL = """
from multigpu.checkpoint.resume import restart_count
from multigpu.testing.faults import KillAt, SlowDisk


def slow():  # the first attempt's disk takes 0.4 s per fsync under checkpoints/: a write lasts seconds
    return SlowDisk(0.4 if restart_count() == 0 else 0.0)


def kill():
    return KillAt(rank=1, step=7, while_writing=True)
"""


def test_a_rank_killed_during_a_background_write_resumes_from_the_last_complete_checkpoint(tmp_path, clean):
    """checkpoint_mode=async (the default): rank 1 is SIGKILLed after step 7 while the checkpoint of step 6 is being
    written in the background (a slow disk keeps it in flight); the restarted group resumes from step 3, the last
    complete checkpoint, nothing of the half-written one is used or left, and the run ends bit-identical."""
    (tmp_path / "slow_kill.py").write_text(_SLOW_KILL)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    faulty = _train(tmp_path / "faulty", "--max-restarts", "1", "callbacks=[slow_kill:slow,slow_kill:kill]", env=env)
    assert faulty.returncode == 0, faulty.stderr[-3000:]
    out = faulty.stdout
    assert "fault: killing rank 1 after step 7 while checkpoint step_00000006 is being written" in out, out
    # the slow write of step 3 was still running when step 6 came due: the run waited, and said so once
    first_attempt = out.split("restart 1: ")[0]
    assert first_attempt.count("is still being written when step") == 1, out
    assert "checkpoint: step_00000003 is still being written when step 6 is due" in first_attempt, out
    assert f"restart 1: resuming from {tmp_path}/faulty/checkpoints/step_00000003" in out, out
    assert f"done: step {STEPS}" in out
    folder = tmp_path / "faulty" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000015", "step_00000016"]  # keep_last 2, no .tmp
    assert CheckpointStore(folder, warn=pytest.fail).latest() == folder / f"step_{STEPS:08d}"
    _assert_same_end(tmp_path / "faulty", clean, "killed during a background write")


def _lines(stream, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)


@pytest.mark.parametrize("sig,code,last_line", [
    (signal.SIGINT, 130, "error: interrupted"),
    (signal.SIGTERM, 143, "error: stopped by SIGTERM: every worker was stopped"),
])
def test_a_signal_writes_a_last_checkpoint_then_stops_every_rank(tmp_path, sig, code, last_line):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "multigpu", "train", "-f", "nano", "--nproc-per-node", "2",
         "--run-dir", str(run_dir), "--checkpoint-on-interrupt", *TINY, "steps=100000", "checkpoint_every=0",
         "log_every=1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    out: list[str] = []
    errs: list[str] = []
    readers = [threading.Thread(target=_lines, args=(stream, sink), daemon=True)
               for stream, sink in ((proc.stdout, out), (proc.stderr, errs))]  # the only readers of the pipes
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 120
    while not any(line.startswith("step 3/") for line in out):
        assert time.monotonic() < deadline and proc.poll() is None, ("".join(out), "".join(errs))
        time.sleep(0.1)
    workers = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    assert len(workers) >= 2
    start = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=60)
    elapsed = time.monotonic() - start
    for reader in readers:
        reader.join(timeout=5)
    stdout, err = "".join(out), "".join(errs)
    assert proc.returncode == code, (stdout[-2000:], err[-3000:])
    assert err.strip().endswith(last_line), err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]  # one line, not one per rank
    stopped = [line for line in stdout.splitlines() if line.startswith("interrupted after step ")]
    assert len(stopped) == 1, stdout[-2000:]
    # the whole command continues the run: --nproc-per-node and all (it used to drop them: 1 rank, half the batch)
    again = shlex.join(["multigpu", "train", "-f", "nano", "--nproc-per-node", "2", "--checkpoint-on-interrupt", *TINY,
                        "steps=100000", "checkpoint_every=0", "log_every=1", "--run-dir", str(run_dir.resolve()),
                        "--resume", "auto"])
    assert stopped[0].endswith(f"; continue with: {again}"), stopped[0]
    step = int(stopped[0].split()[3].rstrip(":"))
    store = CheckpointStore(run_dir / "checkpoints", warn=pytest.fail)
    assert store.latest() == store.path_for(step)  # complete, every file full size, checksums match
    assert torch.load(store.path_for(step) / "state.pt", weights_only=True)["trainer"]["step"] == step
    assert elapsed < 20, elapsed
    time.sleep(0.5)
    alive = [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"orphaned workers: {alive}"


def test_an_fsdp_rank_killed_at_a_random_step_is_restarted_and_ends_bit_identical(tmp_path, fault_rng):
    """The same with strategy=fsdp: the sharded checkpoint (DCP shards in the step folder) carries the run."""
    from safetensors.torch import load_file

    kill_at = fault_rng.randint(4, STEPS - 1)  # after the first checkpoint (step 3)
    fault, env = fault_callback(tmp_path, rank=1, step=kill_at)
    fsdp = ["strategy=fsdp", "export=safetensors"]
    faulty = _train(tmp_path / "faulty", "--max-restarts", "1", *fsdp, fault, env=env)
    assert faulty.returncode == 0, f"kill at step {kill_at}:\n{faulty.stderr[-3000:]}"
    last_checkpoint = (kill_at - 1) // 3 * 3
    assert f"restart 1: resuming from {tmp_path}/faulty/checkpoints/step_{last_checkpoint:08d}" in faulty.stdout
    assert (tmp_path / "faulty" / "checkpoints" / f"step_{STEPS:08d}" / "__1_0.distcp").is_file()
    clean = _train(tmp_path / "clean", *fsdp)
    assert clean.returncode == 0, clean.stderr[-3000:]
    a, b = (load_file(tmp_path / run / "model.safetensors") for run in ("faulty", "clean"))
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"kill at step {kill_at}: parameters differ from the uninterrupted run: {different}"
