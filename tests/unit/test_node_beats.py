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
    session._store = session._beat_client = store  # connected: the store every launcher reaches (one connection)
    return session


def _wait(what: str, done, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_lost_node_that_joins_again_is_watched_again_and_named_when_lost_again(tmp_path):
    store = HashStore()
    # a deadline of 1.5 s (beats every 0.375 s): at 0.4 s a loaded machine held node 1's live heartbeat thread back
    # past it now and then (1 run in 4), and node 1 was taken for lost before it was stopped
    survivor, lost = _node(store, 0, 1.5), []
    survivor.start_beats(str(tmp_path), lost.append)
    try:
        for round_ in (1, 2):  # the node's first launcher, then the one that joined again
            node1 = _node(store, 1, 1.5)
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
    session._store = session._beat_client = store
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


def test_a_node_that_ended_or_never_beat_is_not_lost_and_a_silent_one_is_named_once_with_its_steps(tmp_path):
    """Mutation testing: the heartbeat's own rules, each able to fail. A node posts its count, host and its ranks'
    steps; a node that said it ended is never lost; a node never heard of is not lost (only a count that stood
    still); a silent node is lost once, after the deadline, with its last heartbeat; nothing is said over a store
    not opened yet."""
    import struct

    from multigpu.runtime import progress

    steps = tmp_path / "steps"
    steps.mkdir()
    (steps / "local0").write_bytes(struct.pack(progress._FORMAT, 123, 2, 7))  # rank 2 finished 7 steps
    store = HashStore()
    lost: list[int] = []
    watcher = _node(store, 0, 0.6)
    watcher.nnodes = 4
    watcher.start_beats(str(tmp_path / "none"), lost.append)
    ended, silent = _node(store, 1, 0.6), _node(store, 2, 0.6)
    ended.nnodes = silent.nnodes = 4
    unopened = _node(None, 3, 0.6)
    unopened.nnodes = 4
    unopened.start_beats(str(steps), lost.append)  # its store is not open: it waits, says nothing
    try:
        ended.start_beats(str(steps), lambda node: None)
        silent.start_beats(str(steps), lambda node: None)
        _wait("both heartbeats", lambda: all(watcher._beats.get(n, {}).get("n", 0) >= 2 for n in (1, 2)))
        beat = watcher._beats[2]
        assert beat["host"] == "host2" and beat["steps"] == {"2": 7}
        ended.stop_beats("finished")
        silent._beat_stop.set()  # killed: no word
        silent._beat_thread.join()
        _wait("node 2 lost", lambda: lost == [2], within_s=10)
        time.sleep(1.0)  # more than the deadline again: named once, and node 1 never
        assert lost == [2] and sorted(watcher.lost) == [2] and watcher.lost[2]["host"] == "host2"
        assert watcher._beats[1]["end"] == "finished" and 3 not in watcher.lost and 3 not in watcher._beats
        assert watcher.wait_lost(0.1) == [2]
        assert nodes.lost_line(watcher, 2).startswith("node 2 (host2) (rank 2) was lost: its launcher sent no "
                                                      "heartbeat for 0.6s")
        assert nodes.lost_line(watcher, 2).endswith("; last step finished: rank 2: 7")
    finally:
        for session in (watcher, ended, unopened):
            session.stop_beats("ended")
    assert store.check(["multigpu/nodes/job/beat/0"]) and not store.check(["multigpu/nodes/job/beat/3"])


def test_wait_lost_returns_at_once_when_every_other_node_ended():
    store = HashStore()
    watcher, other = _node(store, 0, 5.0), _node(store, 1, 5.0)
    watcher.start_beats("/nonexistent", lambda node: None)
    other.start_beats("/nonexistent", lambda node: None)
    try:
        _wait("node 1's heartbeat", lambda: watcher._beats.get(1, {}).get("n", 0) >= 1)
        other.stop_beats("finished")
        _wait("node 1's end", lambda: watcher._beats.get(1, {}).get("end") == "finished")
        start = time.monotonic()
        assert watcher.wait_lost(30.0) == [] and time.monotonic() - start < 5
    finally:
        watcher.stop_beats("ended")


class _SetFails:
    """A store whose writes fail (node 0's store gone for this node's writes), reads still answered."""

    def __init__(self, real):
        self.real = real

    def set(self, key, value):
        raise RuntimeError("Connection reset by peer")

    def check(self, keys):
        return self.real.check(keys)

    def get(self, key):
        return self.real.get(key)


def test_the_first_beat_counts_from_1_a_store_opened_later_starts_the_beat_and_a_failed_write_stops_nothing():
    store = HashStore()
    late = _node(None, 1, 40.0)  # one beat a second
    late.start_beats("/nonexistent", lambda node: None)
    try:
        time.sleep(0.3)
        assert not store.check(["multigpu/nodes/job/beat/1"])  # no store yet: nothing posted
        late._store = late._beat_client = store  # torch's rendezvous opened it
        _wait("the first beat", lambda: store.check(["multigpu/nodes/job/beat/1"]))
        assert _node(store, 0, 40.0)._get("beat/1")["n"] == 1
    finally:
        late.stop_beats("ended")
    lost: list[int] = []
    watcher = _node(_SetFails(store), 0, 0.5)
    other = _node(store, 2, 0.5)
    watcher.nnodes = other.nnodes = 3
    other.start_beats("/nonexistent", lambda node: None)
    watcher.start_beats("/nonexistent", lost.append)
    try:
        _wait("node 2's heartbeat", lambda: watcher._beats.get(2, {}).get("n", 0) >= 2)
        other._beat_stop.set()
        other._beat_thread.join()
        _wait("node 2 lost although this node cannot write", lambda: lost == [2])
    finally:
        watcher._beat_stop.set()
        watcher._beat_thread.join()


def test_a_lost_node_whose_launcher_says_it_ended_stays_lost():
    """A node found lost whose launcher later posts that it ended (it was stuck, then stopped) is not taken for
    a node that joined again: it stays lost and is not watched again (mutation testing)."""
    store = HashStore()
    lost: list[int] = []
    watcher, late = _node(store, 0, 0.5), _node(store, 1, 0.5)
    late.start_beats("/nonexistent", lambda node: None)
    watcher.start_beats("/nonexistent", lost.append)
    try:
        _wait("node 1's heartbeat", lambda: watcher._beats.get(1, {}).get("n", 0) >= 2)
        late._beat_stop.set()
        late._beat_thread.join()
        _wait("node 1 lost", lambda: lost == [1])
        late._set("beat/1", {"end": "stopped", "host": "host1"})
        time.sleep(1.0)  # the watcher reads it a few times
    finally:
        watcher.stop_beats("ended")
    assert lost == [1] and 1 in watcher.lost


def test_a_beat_posted_before_the_failure_but_read_after_it_does_not_make_a_killed_node_alive(tmp_path):
    """verdict() counts a node as alive when it heard its heartbeat after the ranks failed. A killed node's last
    beat, posted just before the kill, is read up to one read interval later: it is no sign of life. Before, it
    was taken for one (seen in a full test run: a node killed and started again was not named as the cause,
    the restart said "lost their peers on another node, whose own output says why" and recorded nothing)."""
    store = HashStore()
    watcher, killed = _node(store, 0, 1.5), _node(store, 1, 1.5)
    killed.start_beats(str(tmp_path), lambda node: None)
    watcher.start_beats(str(tmp_path), lambda node: None)
    try:
        _wait("node 1's heartbeat", lambda: watcher._beats.get(1, {}).get("n", 0) >= 2)
        killed._beat_stop.set()  # SIGKILLed: no more beats, no word
        killed._beat_thread.join()
        since = time.monotonic()  # the survivor's ranks lost their peer
        last = killed._beats[1]["n"]
        killed._set("beat/1", {**killed._beats[1], "n": last + 1})  # its last beat, posted as it was killed
        found = watcher.verdict(since, watcher.beat_deadline_s + 2 * nodes.BEAT_S)
    finally:
        watcher.stop_beats("ended")
    assert list(found) == [1] and found[1][0] == "node 1 (host1), lost", found
