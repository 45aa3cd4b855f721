"""Another local user must not run code as the job's user through its stores.

torch's c10d rendezvous handler unpickles the value of ``torch.rendezvous.<run_id>`` on every sync. The probe
that found it: a pure-Python store client run as ``nobody`` read the store's port from ``/proc/net/tcp`` and
the run id from a folder name under the (world-readable) log folder, planted a pickle during a 2-rank job, and
a file owned by the job's user appeared within a second. Here that attack runs for real, as ``nobody``
(``tests/scripts/store_attacker.py``, stdlib only), against a running 2-rank ``multigpu launch``: the marker
never appears, the job ends cleanly, ``nobody`` cannot list the log folder, and the ranks met through a
FileStore in a private folder, not through the workers' TCP store the attacker can reach.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.cli.test_launch_processes import WITHIN_S, _gone_within, _Jobs, _listening, _pids
from tests.conftest import SCRIPTS

pytestmark = [pytest.mark.e2e, pytest.mark.fault]

_NOBODY = 65534


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(_NOBODY)
    os.setuid(_NOBODY)


def _python_for_nobody() -> str | None:
    """A Python interpreter ``nobody`` may run (the attacker needs only the standard library)."""
    for candidate in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
        try:
            if candidate and subprocess.run([candidate, "-I", "-c", "pass"], preexec_fn=_as_nobody, cwd="/",
                                            capture_output=True, timeout=30).returncode == 0:
                return candidate
        except OSError:
            continue
    return None


def _run_as_nobody(python: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    # the source goes on the command line: nobody may not be able to read this checkout
    source = (SCRIPTS / "store_attacker.py").read_text()
    return subprocess.run([python, "-I", "-c", source, *args], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=_as_nobody, cwd="/", env={"PATH": os.environ["PATH"]})


@pytest.fixture
def jobs():
    tracked = _Jobs()  # every process the test started is killed after it, pass or fail
    yield tracked
    tracked.cleanup()


@pytest.fixture
def world_readable_folder():
    """A folder like a user's project folder (0755), for the job's log folder: pytest's tmp_path is 0700."""
    folder = Path(tempfile.mkdtemp(prefix="multigpu_attack_", dir="/tmp"))  # the session's TMPDIR is 0700
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="running the attacker as another "
                    "user needs setuid (root); CI runs as root")
def test_another_user_cannot_run_code_through_the_stores_of_a_running_job(jobs, tmp_path, world_readable_folder):
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python interpreter on this machine that nobody may run")
    logs = world_readable_folder / "logs"
    marker = world_readable_folder / "pwned"  # nobody cannot create it here: only the job's user can
    proc = jobs.start("launch", "--nproc-per-node", "2", "--log-dir", str(logs),
                      str(SCRIPTS / "barrier_until_stop.py"), str(tmp_path))
    pids = jobs.watch(_pids(tmp_path, "pid", 2, proc))
    assert {(tmp_path / f"store{r}").read_text() for r in (0, 1)} == {"FileStore"}
    ports = sorted({port for pid, _, port in _listening([proc.pid]) if pid == proc.pid})
    run_id = next(logs.iterdir()).name.rsplit("_", 1)[0]  # as if it had leaked
    attack = _run_as_nobody(python, "--ports", ",".join(map(str, ports)), "--logs", str(logs), "--run-id", run_id,
                            "--marker", str(marker), "--seconds", "4")
    (tmp_path / "stop").touch()
    out, err = proc.communicate(timeout=90)
    assert attack.returncode == 0, attack.stderr
    report = json.loads(attack.stdout)
    assert report["uid"] == _NOBODY
    assert not marker.exists(), f"the attacker ran code as the job's user through the store (job: {err[-400:]})"
    assert report["ports"] and report["writes"] > 0, report  # it found the job's store(s) and wrote to them
    assert proc.returncode == 0, err
    assert not report["logs_readable"], f"nobody can list the job's log folder: {report}"
    _gone_within(pids, WITHIN_S)  # the workers ended with the job


def test_a_planted_rendezvous_state_ends_a_multi_node_job_in_one_line_and_runs_nothing(jobs, tmp_path):
    """Several nodes: the rendezvous store is on the network (here: a store the test hosts, as a cluster's would
    be). A pickle written over the rendezvous state mid-run is refused by every node before torch unpickles it:
    each launcher ends with one line naming tampering, and the pickle's marker never appears. (A worker that
    saw its peer stopped may print its traceback before that line; this test does not check that.)"""
    import base64
    import pickle
    from datetime import timedelta

    from torch.distributed import TCPStore

    from multigpu.launch.stores import TAMPERED

    class Planted:
        def __reduce__(self):
            return open, (str(tmp_path / "pwned"), "w")

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    nodes = [jobs.start("launch", "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1",
                        "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false",
                        str(SCRIPTS / "barrier_until_stop.py"), str(tmp_path),
                        env={"MULTIGPU_RDZV_SECRET": "0123456789abcdef0123"}) for r in range(2)]
    jobs.watch(_pids(tmp_path, "pid", 2, nodes[0]))
    assert [key for key in store.list_keys() if key.startswith("torch.rendezvous.")]  # anyone can find it
    store.set("torch.rendezvous.multigpu", base64.b64encode(pickle.dumps(Planted())))
    errs = [node.communicate(timeout=90)[1] for node in nodes]
    assert not (tmp_path / "pwned").exists(), f"the planted pickle ran: {errs}"
    for node, err in zip(nodes, errs, strict=True):
        last = err.strip().splitlines()[-1]
        assert node.returncode == 1 and last.startswith("error: the job was stopped: ") and TAMPERED in last, err


_CPP_DUMP = ("frame #", "Exception raised from", "c10::", "TCPStore.cpp")
"""What torch's C++ prints when a store call fails under it (a warning with its stack, frame by frame)."""


@pytest.mark.parametrize("planted", ["pickle", "not_base64"])
def test_tampered_state_in_the_store_node_0_hosts_ends_every_node_in_one_line_naming_the_store_and_key(
        jobs, tmp_path, planted):
    """Node 0 hosts the rendezvous store (the default), and someone writes over the rendezvous state mid-run: a
    signed-looking pickle, or a value that is not even base64 (which torch's backend decodes first). Every node
    ends (exit 1) with one line naming the tampering, the store's address and the key; none blames "node 0 was
    lost" (node 0 used to end first and take the store with it), none prints torch's "The state object is
    corrupt", and the launchers print no C++ dump (torch's warnings of store calls that failed, with their frames).
    The ranks' own lines (teed, ``[rankN]:``) may report their lost peer."""
    import base64
    import pickle
    import socket
    from datetime import timedelta

    from torch.distributed import TCPStore

    from multigpu.launch.stores import TAMPERED

    class Planted:
        def __reduce__(self):
            return open, (str(tmp_path / "pwned"), "w")

    held = socket.socket()  # a port bound, not listening, until node 0's launcher takes it: no fixed port
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    held.bind(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{held.getsockname()[1]}"
    try:
        nodes = [jobs.start("launch", "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "1",
                            "--rdzv-endpoint", endpoint, str(SCRIPTS / "barrier_until_stop.py"), str(tmp_path),
                            env={"MULTIGPU_RDZV_SECRET": "0123456789abcdef0123", "OMP_NUM_THREADS": "1"})
                 for r in range(2)]
        jobs.watch(_pids(tmp_path, "pid", 2, nodes[0]))
        client = TCPStore("127.0.0.1", held.getsockname()[1], is_master=False, timeout=timedelta(seconds=30))
        key = "torch.rendezvous.multigpu"
        value = base64.b64encode(pickle.dumps(Planted())) if planted == "pickle" else b"{not base64!}"
        client.set(key, value)
        errs = [node.communicate(timeout=90)[1] for node in nodes]
    finally:
        (tmp_path / "stop").touch()
        held.close()
    assert not (tmp_path / "pwned").exists(), f"the planted pickle ran: {errs}"
    for rank, (node, err) in enumerate(zip(nodes, errs, strict=True)):
        mine = [line for line in err.strip().splitlines() if not line.startswith("[rank")]  # the launcher's own
        said = f"node {rank} (exit {node.returncode}):\n{err}"
        assert node.returncode == 1, said
        assert not [line for line in err.splitlines() if any(d in line for d in _CPP_DUMP)], said
        assert [line for line in mine if not line.startswith("multigpu: no GPU visible")] == [mine[-1]], said
        assert mine[-1].startswith("error: the job was stopped: ") and TAMPERED in mine[-1], said
        assert f"key {key} in the rendezvous store at {endpoint}" in mine[-1], said
        assert "was lost" not in err and "The state object is corrupt" not in err, said
