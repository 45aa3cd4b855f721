"""No process outlives its job, signals end the launcher at any moment, and a one-node job listens on loopback only.

These pin leftover processes, signals and listening sockets with real signals sent to real launchers:

* SIGKILL of the launcher: every worker dies within seconds (the worker wrapper's
  ``PR_SET_PDEATHSIG``); plain torchrun leaves them all running (benchmarks/RESULTS.md);
* a signal while the agent is still starting the workers (torch's agent is
  slowed down by a test wrapper): the workers started so far are stopped, no
  other is started;
* processes a rank started (a child, a daemon in its own session) are stopped
  when the job ends, after a successful run too;
* SIGINT and SIGTERM to the launcher of a running job: one line, exit 130 / 143,
  no worker left; the job's listening sockets are all on loopback;
* Ctrl-C while a node waits for the rendezvous store: exit 130 at once (torch's
  store client ignored it for its whole timeout).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from multigpu.launch.rendezvous import is_loopback
from tests.conftest import ROOT, SCRIPTS

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

WITHIN_S = 10
"""What "within seconds" means here, with margin for a loaded 2-core machine."""

_NOTE = "multigpu: no GPU visible: running"


class _Jobs:
    """Launchers a test starts; after the test, pass or fail, every process they or their workers started is
    killed (a failing test must not leave processes behind either)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.others: list[psutil.Process] = []

    def start(self, *args: str, cli: list[str] | None = None, capture: bool = True,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        out = subprocess.PIPE if capture else subprocess.DEVNULL
        # as typed at a terminal: SIGINT at its default (a `make test &` in a script starts everything with it
        # ignored, which a Ctrl-C test must not inherit)
        proc = subprocess.Popen([*(cli or [sys.executable, "-m", "multigpu"]), *args], cwd=ROOT, text=True,
                                stdout=out, stderr=out,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src"), **(env or {})},
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        self.procs.append(proc)
        return proc

    def watch(self, pids):
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self.others.append(psutil.Process(pid))
        return pids

    def cleanup(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(psutil.Error):
                self.others += psutil.Process(proc.pid).children(recursive=True)
            if proc.poll() is None:
                proc.kill()
        for other in self.others:
            with contextlib.suppress(psutil.Error):
                other.kill()  # psutil refuses a pid that now names another process
        for proc in self.procs:
            proc.wait(timeout=30)
            for stream in (proc.stdout, proc.stderr):
                if stream:
                    stream.close()


@pytest.fixture
def jobs():
    tracked = _Jobs()
    yield tracked
    tracked.cleanup()


def _pids(folder: Path, prefix: str, count: int, proc: subprocess.Popen) -> list[int]:
    deadline = time.monotonic() + 90
    while len(list(folder.glob(f"{prefix}*"))) < count:
        assert time.monotonic() < deadline and proc.poll() is None, f"the job ended or stalled (exit {proc.poll()})"
        time.sleep(0.1)
    return [int(p.read_text()) for p in folder.glob(f"{prefix}*")]


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _gone_within(pids, limit_s: float) -> float:
    """Seconds until none of ``pids`` runs; fails (killing the rest) past ``limit_s``."""
    start = time.monotonic()
    while _alive(pids):
        if time.monotonic() - start > limit_s:
            left = _alive(pids)
            for pid in left:
                psutil.Process(pid).kill()
            pytest.fail(f"processes still running {limit_s}s after their launcher ended: {left}")
        time.sleep(0.05)
    return time.monotonic() - start


def _workers(proc: subprocess.Popen) -> set[int]:
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for child in children:
        try:
            if any(part.endswith("_worker.py") for part in child.cmdline()):
                found.add(child.pid)
        except psutil.Error:
            pass
    return found


def _listening(pids) -> list[tuple[int, str, int]]:
    out = []
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                out.append((pid, conn.laddr.ip, conn.laddr.port))
    return out


_STOPPED = "multigpu: stopped "
"""What the launcher stopped that the workers left running (said after a signal too; the count depends on how far
the workers had got)."""


def _stderr_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip() and not line.startswith((_NOTE, _STOPPED))]


def _private_folders() -> set[Path]:
    """The stores' private folders in the session's TMPDIR (the launchers' too)."""
    tmp = Path(tempfile.gettempdir())
    return {*tmp.glob("multigpu_store_*"), *tmp.glob("multigpu_rdzv_*"), *tmp.glob("multigpu_store_*/multigpu_rdzv_*")}


@pytest.mark.parametrize("sig,code,line", [
    (signal.SIGINT, 130, "error: interrupted"),
    (signal.SIGTERM, 143, "error: stopped by SIGTERM: every worker was stopped"),
])
def test_a_running_one_node_job_listens_on_loopback_and_a_signal_stops_it_with_one_line(jobs, tmp_path, sig, code,
                                                                                        line):
    """Sockets: the rendezvous store, the workers' store and gloo listen on loopback only (torch's own stores
    listen on every interface). Signals: Ctrl-C once printed 98 lines of tracebacks; SIGTERM exited 1. The
    one-node stores are FileStores in a private folder, removed after a signal too."""
    private = _private_folders()
    proc = jobs.start("launch", "--nproc-per-node", "2", str(SCRIPTS / "sleep_forever.py"), str(tmp_path))
    pids = jobs.watch(_pids(tmp_path, "pid", 2, proc))
    sockets = _listening([proc.pid, *pids])
    # the workers' store; the rendezvous store of one node is a FileStore in a private folder
    assert len([s for s in sockets if s[0] == proc.pid]) == 1, sockets
    exposed = [s for s in sockets if not is_loopback(s[1])]
    assert not exposed, f"listening beyond loopback: {exposed} (all: {sockets})"
    start = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < WITHIN_S
    assert proc.returncode == code, err
    assert _stderr_lines(err) == [line], err  # one line: no rank's traceback, no agent log
    _gone_within(pids, WITHIN_S)
    assert _private_folders() == private


_CALLED = [sys.executable, "-c", "import sys; from multigpu.cli import main; sys.exit(main(sys.argv[1:]))"]
"""The command line called from code: its workers are fresh interpreters (``python -u _worker.py ...``)."""

_HELD_SITE = """import os, time
gate = os.environ.get("TEST_SITE_GATE")
if gate and os.environ.get("RANK") is not None:  # the workers only
    open(os.path.join(gate, "in_site" + os.environ["RANK"]), "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(gate, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)
"""
"""A ``sitecustomize`` that holds each worker's interpreter inside ``import site`` (its start-up) until the test
says go (never, here), having said it is there."""


def test_ctrl_c_while_the_workers_start_up_stops_them_with_one_line(jobs, tmp_path):
    """SIGINT reaching a worker while its interpreter still imported ``site`` used to print Python's
    "Fatal Python error: init_import_site: Failed to import the site module ... KeyboardInterrupt", once per worker
    (and a KeyboardInterrupt traceback while it imported torch). The launcher gets SIGINT once both workers are
    inside ``site``, where they stay (a 3 s sleep there once let a slow machine's workers past it first). Workers
    with an interpreter of their own: the launcher called from code (``main(argv)``), which starts them as fresh
    processes (the console script forks them instead). The launcher returns within seconds: it once waited
    torch's 30 s stop timeout for the held workers, which had the signal pending, then SIGKILLed them."""
    slow = tmp_path / "slow_site"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(_HELD_SITE)
    gate = tmp_path / "gate"
    gate.mkdir()
    proc = jobs.start("launch", "--nproc-per-node", "2", str(SCRIPTS / "sleep_forever.py"), str(tmp_path),
                      env={"PYTHONPATH": os.pathsep.join([str(slow), str(ROOT / "src")]), "TEST_SITE_GATE": str(gate)},
                      cli=_CALLED)
    deadline = time.monotonic() + 90
    while len(list(gate.glob("in_site*"))) < 2:
        assert time.monotonic() < deadline and proc.poll() is None, f"the workers did not start (exit {proc.poll()})"
        time.sleep(0.02)
    pids = jobs.watch(sorted(_workers(proc)))
    assert len(pids) == 2
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    # the agent waited its whole 30 s stop timeout for workers that had the signal pending, then SIGKILLed them
    assert time.monotonic() - start < WITHIN_S, f"Ctrl-C took {time.monotonic() - start:.1f} s to return"
    assert "Fatal Python error" not in err and "init_import_site" not in err and "Traceback" not in err, err
    assert proc.returncode == 130, err
    assert _stderr_lines(err) == ["error: interrupted"], err
    _gone_within(pids, WITHIN_S)
    assert not list(tmp_path.glob("pid*")), "the script ran after Ctrl-C"


def test_a_sigkilled_launcher_leaves_no_worker(jobs, tmp_path):
    """Leftover processes: SIGKILL of the launcher (torchrun: every worker runs on with parent 1)."""
    proc = jobs.start("launch", "--nproc-per-node", "2", str(SCRIPTS / "sleep_forever.py"), str(tmp_path),
                      capture=False)
    pids = jobs.watch(_pids(tmp_path, "pid", 2, proc))
    proc.kill()
    proc.wait(timeout=30)
    _gone_within(pids, WITHIN_S)


def test_a_sigkilled_launcher_leaves_nothing_its_workers_started(jobs, tmp_path):
    """With the launcher SIGKILLed, both workers died (PR_SET_PDEATHSIG) but the 4 processes
    they started (a child and a setsid daemon each) ran on with parent 1. The reaper that outlives the launcher
    stops every process carrying the job's token, then removes the job's private store folder."""
    private = _private_folders()
    proc = jobs.start("launch", "--nproc-per-node", "2", str(SCRIPTS / "fork_children.py"), str(tmp_path),
                      "wait", capture=False)
    workers = jobs.watch(_pids(tmp_path, "pid", 2, proc))
    started = jobs.watch([int((tmp_path / f"{kind}{r}").read_text()) for kind in ("child", "daemon") for r in (0, 1)])
    assert len(_alive(started)) == 4
    assert len(_private_folders() - private) == 2  # the job's folder, its rendezvous store's inside
    proc.kill()
    proc.wait(timeout=30)
    _gone_within([*workers, *started], WITHIN_S)
    deadline = time.monotonic() + 3 * WITHIN_S  # the reaper removes it after the sweep; slower on a loaded host
    while _private_folders() - private:  # this job's (a folder of an earlier job may go meanwhile)
        assert time.monotonic() < deadline, "the killed launcher's private folder was left"
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_signal_while_workers_start_stops_those_started_and_starts_no_more(jobs, tmp_path, sig):
    """Leftover processes: a launcher signalled while its workers started left them running (42 of 1,000 after SIGTERM).
    The test wrapper holds the agent after it has started the first of 4 workers; the signal comes then (a 1.5 s
    wait after each start once let a slow machine start a second before the signal)."""
    gate = tmp_path / "gate"
    gate.mkdir()
    cli = [sys.executable, str(SCRIPTS / "slow_start_cli.py"), str(gate)]
    proc = jobs.start("launch", "--nproc-per-node", "4", str(SCRIPTS / "sleep_forever.py"), str(tmp_path), cli=cli)
    deadline = time.monotonic() + 90
    while not (gate / "started1").exists():
        assert time.monotonic() < deadline and proc.poll() is None, f"no worker started (exit {proc.poll()})"
        time.sleep(0.02)
    started = _workers(proc)
    assert len(started) == 1, started
    jobs.watch(started)
    proc.send_signal(sig)
    seen = set(started)
    while proc.poll() is None:
        seen |= set(jobs.watch(_workers(proc) - seen))
        assert time.monotonic() < deadline, "the launcher did not end"
        time.sleep(0.02)
    assert seen == started, f"workers started after the signal: {seen - started}"
    if sig == signal.SIGTERM:
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 143, err
        assert _stderr_lines(err) == ["error: stopped by SIGTERM: every worker was stopped"], err
    _gone_within(seen, WITHIN_S)


def test_processes_a_rank_started_end_with_the_job(jobs, tmp_path):
    """Leftover processes: a rank that forks left its children behind after a successful run; a daemon (its own
    session) too."""
    proc = jobs.start("launch", "--nproc-per-node", "2", str(SCRIPTS / "fork_children.py"), str(tmp_path))
    _, err = proc.communicate(timeout=180)
    started = jobs.watch([int(p.read_text()) for p in [*tmp_path.glob("child*"), *tmp_path.glob("daemon*")]])
    assert proc.returncode == 0, err
    assert len(started) == 4
    assert not _alive(started), f"left running after the job: {_alive(started)}"
    assert "multigpu: stopped 4 process(es) that the workers had left running" in err


def test_processes_left_by_a_failed_run_are_stopped_and_said_before_the_error(jobs, tmp_path):
    """The "stopped N process(es)" line comes before the error when the run fails, not only after a successful run."""
    proc = jobs.start("launch", "--nproc-per-node", "2", str(SCRIPTS / "fork_children.py"), str(tmp_path), "3")
    _, err = proc.communicate(timeout=180)
    started = jobs.watch([int(p.read_text()) for p in [*tmp_path.glob("child*"), *tmp_path.glob("daemon*")]])
    assert proc.returncode == 1, err
    assert len(started) == 4 and not _alive(started), f"left running after the job: {_alive(started)}"
    lines = err.strip().splitlines()
    stopped = lines.index("multigpu: stopped 4 process(es) that the workers had left running")
    assert lines[stopped + 1].startswith("error: rank ") and "(exit code 3)" in lines[stopped + 1], err


def test_ctrl_c_while_a_node_waits_for_the_rendezvous_store_stops_at_once(jobs):
    """Signals: node 1 started before node 0 (nothing answers at the endpoint yet): Ctrl-C was ignored until
    torch's store client gave up. The test's socket listens there with its one-connection queue full (its own
    connection), so the node's attempts get no answer: the signal comes while the node is seen connecting (once
    it came after a 2 s sleep, wherever a slow machine's launcher then was)."""
    with socket.socket() as reserved, socket.socket() as filler:
        reserved.bind(("127.0.0.1", 0))
        reserved.listen(0)
        filler.connect(reserved.getsockname())  # the queue is full: further connection requests are dropped
        port = reserved.getsockname()[1]
        endpoint = f"127.0.0.1:{port}"
        cli = [sys.executable, str(SCRIPTS / "fake_gpu_cli.py"), "0"]  # no GPU: the launcher prints its note
        proc = jobs.start("launch", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint,
                          "--nproc-per-node", "1", "examples/hello.py", cli=cli,
                          env={"MULTIGPU_RDZV_SECRET": "0123456789abcdef"})
        assert proc.stderr.readline().startswith(_NOTE)  # past its imports, at the rendezvous
        deadline = time.monotonic() + 90
        while not any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_SYN_SENT
                      for c in psutil.Process(proc.pid).net_connections(kind="tcp")):
            assert time.monotonic() < deadline and proc.poll() is None, f"never connected (exit {proc.poll()})"
            time.sleep(0.02)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert time.monotonic() - start < WITHIN_S
    assert proc.returncode == 130, err
    assert _stderr_lines(err) == ["error: interrupted"], err
