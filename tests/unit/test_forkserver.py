"""The fork server's parts that run in the launcher: the ``Popen`` stand-in torch's agent polls, waits for and
signals, and which commands it forks (only the worker wrapper; anything else is started as torch starts it).
The whole path, with real workers, is tests/cli/test_launch_e2e.py's forked-worker test."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from multigpu.launch import _worker, forkserver
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the fork server is Linux's")


def _child(code: int, sleep_s: float) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        time.sleep(sleep_s)
        os._exit(code)
    return pid


def test_a_forked_worker_reads_as_a_popen_to_torchs_agent():
    proc = forkserver.ForkedProcess(_child(3, 0.3), ("python", "w"))
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.01)
    assert proc.wait(timeout=30) == 3 and proc.poll() == 3 and proc.returncode == 3
    proc.send_signal(signal.SIGTERM)  # after its end: nothing is signalled (the pid may be another's by now)
    killed = forkserver.ForkedProcess(_child(0, 30), ("python", "w"))
    killed.kill()
    assert killed.wait(timeout=30) == -signal.SIGKILL


def test_only_the_worker_wrapper_is_forked():
    assert forkserver._worker_argv(sys.executable, ["-u", _worker.__file__, "-m", "pkg", "a"]) == ["-m", "pkg", "a"]
    assert forkserver._worker_argv(sys.executable, ["-u", "other.py"]) is None
    assert forkserver._worker_argv("/usr/bin/env", ["-u", _worker.__file__]) is None


def test_without_a_fork_server_the_agent_starts_workers_as_torch_does():
    from torch.distributed.elastic.multiprocessing import api

    before = api.get_subprocess_handler
    assert forkserver._SERVER is None  # only a process started for the command makes one
    with forkserver.serving():
        assert api.get_subprocess_handler is before
    assert not forkserver.available()


def test_the_worker_takes_the_thread_counts_its_environment_asks_for(monkeypatch):
    import torch

    asked = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    blas = []
    monkeypatch.setattr(forkserver, "_openblas_threads", blas.append)
    forkserver._thread_counts({"OMP_NUM_THREADS": "1"})
    forkserver._thread_counts({"OMP_NUM_THREADS": "2", "OPENBLAS_NUM_THREADS": "3"})
    forkserver._thread_counts({})
    assert asked == [1] and blas == [1, 3]


def _worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIGPU_", "TORCHELASTIC_"))}
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1"}


@pytest.mark.parametrize("answer, why", [
    ("gone", "the fork server is gone"),
    ("silent", "the fork server did not answer within 0.3 s"),
    ("threaded", "the fork server has started a thread"),
])
def test_a_fork_server_that_fails_is_given_up_with_a_note_and_the_worker_starts_as_a_new_interpreter(
        monkeypatch, tmp_path, capsys, answer, why):
    """The job goes on (the worker is a new interpreter, as without a server), one line says why, and the server is
    stopped and asked nothing more; it used to wait on a silent server forever."""
    from torch.distributed.elastic.multiprocessing import api

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if answer == "gone":
        theirs.close()
    elif answer == "threaded":
        theirs.sendall((-forkserver._THREADED).to_bytes(8, "little", signed=True))
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # stands in for the server
    monkeypatch.setattr(forkserver, "_REPLY_S", 0.3)
    monkeypatch.setattr(forkserver, "_SERVER", forkserver._Server(ours, server.pid))
    monkeypatch.setattr(forkserver, "_is_subreaper", lambda: True)
    script = tmp_path / "script.py"
    script.write_text("print('ran in', __import__('sys').argv[0])\n")
    try:
        with forkserver.serving():
            handler = api.get_subprocess_handler(sys.executable, ("-u", _worker.__file__, str(script)), _worker_env(),
                                                 str(tmp_path / "out.log"), str(tmp_path / "err.log"), 0)
        assert isinstance(handler.proc, subprocess.Popen) and handler.proc.wait(timeout=120) == 0
    finally:
        server.kill()
        server.wait()
        theirs.close()
    assert (tmp_path / "out.log").read_text() == f"ran in {script}\n", (tmp_path / "err.log").read_text()
    assert forkserver._SERVER is None and not forkserver.available()
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and notes[0].startswith(f"multigpu: note: workers start as new interpreters ({why}"), notes


def test_no_fork_server_is_made_once_a_thread_runs():
    """A fork copies only the forking thread: a lock another thread held stays held in the copy forever (a logging
    handler's, the allocator's), and every worker forked from it could hang. The workers then start as new
    interpreters."""
    code = ("import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "from multigpu.launch import forkserver\nforkserver.start()\nprint(forkserver._SERVER is None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_worker_env())
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-2000:]


def test_a_worker_starts_withfresh_random_state_whatever_the_fork_server_seeded():
    """Issue 48: a worker forked from the server drew torch's stream of the server (the same on every rank). A module
    the server preloaded may even have seeded torch (``torch.manual_seed`` also leaves a CUDA seed queued for CUDA's
    start): a worker has none of it, as a new interpreter, whose CUDA generators torch seeds from the OS."""
    code = ("import json, os, random, sys\nimport numpy, torch\n"
            "from multigpu.launch import forkserver\n"
            "torch.manual_seed(5); numpy.random.seed(5); random.seed(5)\n"
            "assert any(torch.cuda._lazy_seed_tracker.get_calls())\n"
            "for _ in range(2):\n"
            "    if os.fork() == 0:\n"
            "        forkserver.fresh_random_state()\n"
            "        print(json.dumps([torch.initial_seed(), torch.rand(2).tolist(), random.random(),\n"
            "                          float(numpy.random.rand()), any(torch.cuda._lazy_seed_tracker.get_calls())]),\n"
            "              flush=True)\n"
            "        os._exit(0)\n"
            "    os.wait()\n"
            "print(json.dumps([torch.initial_seed(), torch.rand(2).tolist(), random.random(),\n"
            "                  float(numpy.random.rand()), True]))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr
    first, second, server = (json.loads(line) for line in proc.stdout.splitlines())
    for i, what in enumerate(("torch seed", "torch draws", "random", "numpy")):
        assert len({repr(first[i]), repr(second[i]), repr(server[i])}) == 3, (what, first, second, server)
    assert server[0] == 5 and not first[4] and not second[4]  # no CUDA seed left queued in a worker
