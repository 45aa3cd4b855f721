"""The launchers' heartbeat watch (:func:`multigpu.launch.nodes._beat_loop`) over a real store, in one process.

An elastic job's node that is lost and then joins again (a new launcher with the same node rank, whose heartbeat
counts from 1 again) is watched again, so that losing it a second time is named a second time. Before, a node
once found lost was never read again: its second loss went unnamed, and its ranks' peers waited for NCCL's timeout.
"""

from __future__ import annotations

import time

from torch.distributed import HashStore

from multigpu.launch import nodes


def _node(store, rank: int, deadline_s: float) -> nodes.Nodes:
    session = nodes.Nodes(b"0123456789abcdef0123", "job", 2, rank, rank == 0, 60.0, f"host{rank}", "127.0.0.1:0",
                          min_nodes=1, beat_deadline_s=deadline_s)
    session._store = store  # connected: the store every launcher reaches
    return session


def _wait(what: str, done, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_lost_node_that_joins_again_is_watched_again_and_named_when_lost_again(tmp_path):
    store = HashStore()
    survivor, lost = _node(store, 0, 0.4), []
    survivor.start_beats(str(tmp_path), lost.append)
    try:
        for round_ in (1, 2):  # the node's first launcher, then the one that joined again
            node1 = _node(store, 1, 0.4)
            node1.start_beats(str(tmp_path), lambda node: None)
            _wait("node 1's heartbeat", lambda: 1 not in survivor.lost and survivor._beats.get(1, {}).get("n", 0) > 2)
            node1._beat_stop.set()  # its launcher SIGKILLed: no more beats, no word
            node1._beat_thread.join()
            _wait(f"node 1 found lost ({round_})", lambda round_=round_: len(lost) == round_)
            assert lost == [1] * round_ and 1 in survivor.lost
            assert nodes.lost_line(survivor, 1).startswith("node 1 (host1) was lost: its launcher sent no heartbeat")
    finally:
        survivor.stop_beats("ended")


def _unnumbered(store, hosts: bool, nnodes: int = 3) -> nodes.Nodes:
    """A launcher started with torchrun's elastic flags: no node rank; ``hosts``: it could listen on the endpoint."""
    session = nodes.Nodes(b"0123456789abcdef0123", "job", nnodes, None, hosts, 60.0, "h", "127.0.0.1:0",
                          min_nodes=1, beat_deadline_s=0.4)
    session._store = store
    return session


def test_nodes_without_a_node_rank_take_one_place_each_and_give_it_back():
    """torchrun's form (no --node-rank): the store's host is node 0, the others take the lowest free place. Before,
    every node took itself for node 0. A place is given back when its node ends or is found lost, and a job whose
    places are all taken says so in one line instead of joining a node twice."""
    store = HashStore()
    host, a, b = _unnumbered(store, True), _unnumbered(store, False), _unnumbered(store, False)
    assert [s._take_place(1.0) for s in (host, a, b)] == [0, 1, 2]
    late = _unnumbered(store, False)
    try:
        late._take_place(0.3)
        raise AssertionError("a fourth node took a place of a 3-node job")
    except nodes.RendezvousTimeoutError as exc:
        assert str(exc).startswith("every place of the job's 3 nodes (--nnodes 3) was taken at 127.0.0.1:0")
    a.give_back(1)  # node 1 ended
    b.give_back(1)  # another node's word on a place that is no longer its own changes nothing
    assert late._take_place(1.0) == 1
    host.give_back(2)  # node 2 found lost by node 0: its place goes to the next node that joins
    assert _unnumbered(store, False)._take_place(1.0) == 2
    assert host.node_rank is None and host._place is not None  # _take_place reports; connect() sets the rank
