"""The fork server's parts that run in the launcher: the ``Popen`` stand-in torch's agent polls, waits for and
signals, and which commands it forks (only the worker wrapper; anything else is started as torch starts it).
The whole path, with real workers, is tests/cli/test_launch_e2e.py's forked-worker test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from multigpu.launch import _worker, forkserver

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
