"""The nodes of a multi-node job settle one run folder before torch's agent forms the job
(:meth:`multigpu.launch.nodes.Nodes.agree`, :meth:`~multigpu.launch.nodes.Nodes.check_shared`), over a real store in
one process: node 0 decides and the others learn, only this job's signed values are read, a node that failed
stops the others, and a folder that is not the same folder on every node is refused. Before, only the e2e tests
on loopback nodes reached this code (mutation testing found no fast test of it)."""

from __future__ import annotations

import threading
import time

import pytest
from torch.distributed import HashStore

from multigpu.errors import ConfigError, RendezvousTimeoutError
from multigpu.launch import nodes
from multigpu.launch.stores import RendezvousStateError

SECRET = b"0123456789abcdef0123"


def _node(store, rank: int, *, nnodes: int = 2, run_id: str = "job", secret: bytes = SECRET, timeout_s: float = 10.0,
          min_nodes: int | None = None) -> nodes.Nodes:
    session = nodes.Nodes(secret, run_id, nnodes, rank, rank == 0, timeout_s, f"host{rank}", "127.0.0.1:0",
                          min_nodes=min_nodes)
    session._store = store  # connected: the store every launcher reaches
    return session


def _in_thread(fn):
    """Run ``fn`` in a thread; returns a function that joins it and gives its result (or raises its error)."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()

    def result():
        thread.join(timeout=20)
        assert not thread.is_alive(), "the node never returned"
        if "error" in out:
            raise out["error"]
        return out["value"]

    return result


def test_node_0_decides_once_and_the_others_learn_what_it_decided():
    store = HashStore()
    decided = []
    late = _in_thread(lambda: _node(store, 1).agree("run_name", lambda: decided.append("node 1") or "wrong"))
    time.sleep(0.3)  # node 1 waits for node 0
    assert _node(store, 0).agree("run_name", lambda: decided.append("node 0") or "20261129-1") == "20261129-1"
    assert late() == "20261129-1" and decided == ["node 0"]
    assert _node(store, 2, nnodes=3).agree("run_name", lambda: "x") == "20261129-1"  # a third node, later
    assert store.check(["multigpu/nodes/job/value/run_name"])  # the job's own key
    other = _node(store, 1, run_id="another", timeout_s=0.3)  # another job on the same store sees nothing of it
    with pytest.raises(RendezvousTimeoutError, match=r"^node 1 waited 0.3s at 127.0.0.1:0 for node 0 to settle the "
                                                     r"run name; start node 0 \(--node-rank 0\)"):
        other.agree("run_name", lambda: "x")


def test_a_value_signed_with_another_secret_is_refused_and_a_failed_node_stops_the_waiting_ones():
    store = HashStore()
    _node(store, 0, secret=b"another secret, another job").agree("run_name", lambda: "theirs")
    with pytest.raises(RendezvousStateError, match="value 'value/run_name'"):
        _node(store, 1).agree("run_name", lambda: "x")
    store = HashStore()
    waiting = _in_thread(lambda: _node(store, 1, nnodes=3).agree("run_name", lambda: "x"))
    time.sleep(0.3)
    _node(store, 2, nnodes=3)._set("failed", {"node": 2, "host": "host2", "reason": "error: no such script"})
    with pytest.raises(nodes.NodeFailedError, match="node 2 .*host2.*no such script"):
        waiting()
    assert nodes.Nodes.failure(_node(store, 2, nnodes=3)) is None  # its own failure is not another's
    assert store.check(["multigpu/nodes/job/ack/1"])  # node 1 said it read why


def test_every_node_must_see_node_0s_marker_in_the_run_folder(tmp_path):
    shared = tmp_path / "run"
    shared.mkdir()
    store = HashStore()
    second = _in_thread(lambda: _node(store, 1, nnodes=3).check_shared(shared))
    third = _in_thread(lambda: _node(store, 2, nnodes=3).check_shared(shared))
    _node(store, 0, nnodes=3).check_shared(shared)  # waits for both, then removes its marker
    second(), third()
    assert list(shared.iterdir()) == []
    assert store.check(["multigpu/nodes/job/shared/seen/1", "multigpu/nodes/job/shared/seen/2"])


@pytest.mark.parametrize("exists", [True, False])
def test_a_folder_that_is_not_shared_is_one_line_naming_the_node_and_what_it_found(tmp_path, exists):
    mine, theirs = tmp_path / "node0" / "run", tmp_path / "node1" / "run"
    mine.mkdir(parents=True)
    if exists:
        theirs.mkdir(parents=True)
    store = HashStore()
    host = _in_thread(lambda: _node(store, 0, timeout_s=1.0).check_shared(mine))
    with pytest.raises(ConfigError) as info:
        _node(store, 1).check_shared(theirs)
    message = str(info.value)
    seen = "exists but does not hold node 0's marker" if exists else "does not exist"
    assert message.startswith(f"the run folder is not shared between nodes: node 0 made {theirs} and marked it, but "
                              f"on node 1 (host1) {theirs} {seen}; valid: ") and "\n" not in message
    assert not store.check(["multigpu/nodes/job/shared/seen/1"])
    with pytest.raises(RendezvousTimeoutError, match="for node 1 to find the run folder"):
        host()
    assert list(mine.iterdir()) == []  # node 0 gave up and took its marker away


def test_an_elastic_job_waits_only_for_the_nodes_it_cannot_start_without_and_keeps_its_marker(tmp_path):
    shared = tmp_path / "run"
    shared.mkdir()
    store = HashStore()
    host = _node(store, 0, nnodes=3, min_nodes=2)
    assert host.elastic and not _node(store, 0, nnodes=3, min_nodes=3).elastic and not _node(store, 0).elastic
    second = _in_thread(lambda: _node(store, 1, nnodes=3, min_nodes=2).check_shared(shared))
    host.check_shared(shared)  # node 1 (below MIN) only
    second()
    [marker] = list(shared.iterdir())
    assert host._marker == marker and marker.read_text() == "host0\n"  # kept for a node that joins later
    _node(store, 2, nnodes=3, min_nodes=2).check_shared(shared)  # a node joining later finds it
    assert store.check(["multigpu/nodes/job/shared/seen/2"])


def test_a_marker_someone_else_removed_does_not_break_node_0_and_the_waits_name_what_they_wait_for(tmp_path,
                                                                                                    monkeypatch):
    """Mutation testing: node 0 removes its marker whether the others found it or it gave up, even where the
    marker is gone already; a node that waits for node 0's marker says so; a relative run folder is named with
    the folder it is relative to."""
    shared = tmp_path / "run"
    shared.mkdir()
    store = HashStore()

    def polite_node_1():  # finds the marker, cleans it up itself, then says it saw it
        session = _node(store, 1)
        token = session._wait("shared/token", "the token")
        (shared / f".multigpu-shared-{token}").unlink()
        session._set("shared/seen/1", True)

    helper = _in_thread(polite_node_1)
    _node(store, 0).check_shared(shared)
    helper()
    store = HashStore()
    giving_up = _in_thread(lambda: _node(store, 0, timeout_s=1.0).check_shared(shared))
    deadline = time.monotonic() + 10
    while not list(shared.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)
    for marker in shared.iterdir():
        marker.unlink()
    with pytest.raises(RendezvousTimeoutError, match="for node 1 to find the run folder"):
        giving_up()
    with pytest.raises(RendezvousTimeoutError, match="for node 0 to make the run folder"):
        _node(HashStore(), 1, timeout_s=0.3).check_shared(shared)
    monkeypatch.chdir(tmp_path)
    store = HashStore()
    host = _in_thread(lambda: _node(store, 0, timeout_s=1.0).check_shared(shared))
    with pytest.raises(ConfigError, match=rf"on node 1 \(host1\) elsewhere \(in {tmp_path}\) does not exist"):
        _node(store, 1).check_shared(nodes.Path("elsewhere"))
    with pytest.raises(RendezvousTimeoutError):
        host()
