"""What the nodes of a multi-node job settle before torch's agent forms the job (runs in the launcher).

The launchers of a job of several nodes meet at the rendezvous store before torch's agent does:

* node 0's launcher (the one that hosts the store) opens it on the endpoint's address and the others connect
  (:func:`multigpu.launch.stores.open_store`); the same store then serves torch's rendezvous, handed to the
  ``multigpu`` backend;
* without node ranks (torchrun's elastic form: every node runs the same command, no ``--node-rank``), the
  launcher that can listen on the endpoint's address hosts the store and is node 0; each other node takes the
  lowest free place among 1..nnodes-1 as it joins (:meth:`Nodes.connect`: a ``compare_set`` in the store, so two
  nodes never take one place), gives it back when it ends, and the place of a node found lost is given back for
  the node that joins next;
* node 0 decides, the others learn (:meth:`Nodes.agree`): the run folder's name when none was given, so that a
  job has one run folder on every node;
* every node checks that it sees the run folder node 0 made (:meth:`Nodes.check_shared`): node 0 writes a
  marker with a random token there, the others must find it, else one line: "the run folder is not shared
  between nodes: ...";
* a node that fails before the job forms says so in the store (which node, which host, the error line) and
  closes torch's rendezvous (:meth:`Nodes.tell`): every other node stops within seconds, naming it, whether
  it waits in an agreement here or in torch's rendezvous. The node that hosts the store keeps it open until
  every other node has read why (at most :data:`LINGER_S`).

Everything written to the store is signed with the job's secret (``MULTIGPU_RDZV_SECRET``), like the
rendezvous state, and checked before it is read. One node: nothing here runs (:func:`joined` yields None).

    with nodes.joined(cfg) as session:        # a context for the whole command on this node
        name = session.agree("run_name", lambda: make_the_folder())
        session.check_shared(run_dir)
        launch(...)                           # torch's agent uses the store opened here
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from multigpu.errors import ConfigError, MultigpuError, NodeFailedError, RendezvousTimeoutError

__all__ = ["BEAT_S", "LINGER_S", "Nodes", "job_run_id", "joined", "lost_line",
           "open_session", "placed", "posted_failure", "started_again_line", "store_gone", "store_lost_line", "tell_others"]

LINGER_S = 30.0
"""How long the node hosting the store keeps it open after a failure, for the other nodes to read why."""
TELL_CONNECT_S = 10.0
"""How long a node that failed tries to reach node 0's store to say why."""
STOP_TOGETHER_S = 90.0
"""How long a launcher stopped by the scheduler's warning waits for the other nodes' ranks to stop too
(:meth:`Nodes.stop_together`): torch's agent gives each node's ranks 30 s before it kills them."""
_POLL_S = 0.2
BEAT_S = 1.0
"""How often a launcher posts its heartbeat while the job runs."""
_PREFIX = "multigpu/nodes/"
_MARKER = ".multigpu-shared-"
_sessions: dict[str, Nodes] = {}  # run id -> the open session of this launcher


def job_run_id(run_id: str | None, nnodes: int) -> str:
    """The rendezvous run id: ``--run-id``, else ``multigpu`` on several nodes (every node must use the same one)."""
    import uuid

    return run_id or ("multigpu" if nnodes > 1 else uuid.uuid4().hex[:12])


def _seconds(rdzv_conf: dict[str, str], key: str, default: int) -> float:
    text = str(rdzv_conf.get(key, default))
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}={text} is not a number of seconds; valid: e.g. {key}={default}") from None
    if not value > 0:
        raise ConfigError(f"--rdzv-conf {key}={text} is invalid; valid: seconds > 0, e.g. {key}={default}")
    return value


@dataclass
class Nodes:
    """This launcher's place among the job's launchers, talking through the rendezvous store.

    The store is opened when first needed (an agreement, a failure to tell, torch's rendezvous), not before:
    a launch that fails on its own input before any of these talks to no one."""

    secret: bytes
    run_id: str
    nnodes: int
    node_rank: int | None
    """This node's index; None until it joins, where none was given (its place is then taken in the store)."""
    hosts_store: bool | None
    """Whether this launcher hosts the store; None until it opens it, where no node rank says (torchrun's rule)."""
    join_timeout_s: float
    host: str
    endpoint: str
    read_timeout_s: float = 60.0
    min_nodes: int | None = None
    """An elastic job's fewest nodes (``--nnodes MIN:MAX``); None: exactly ``nnodes``."""
    told: bool = False
    """This node's failure (or another's) was written to the store and the rendezvous closed."""
    _store: object = None
    _beat_client: object = None
    """The heartbeat's own connection to the store (:meth:`beat_store`)."""
    _address: str | None = None
    _marker: Path | None = None
    beat_deadline_s: float = 15.0
    """A node whose launcher sent no heartbeat for this long is lost (torch's rendezvous drops it after the same
    time: ``keep_alive_interval`` × ``keep_alive_max_attempt``)."""
    lost: dict = dataclasses.field(default_factory=dict)
    """{node rank: its last heartbeat} of the nodes found lost while the job ran (:meth:`start_beats`)."""
    _beats: dict = dataclasses.field(default_factory=dict)
    _heard: dict = dataclasses.field(default_factory=dict)
    """{node rank: when (this machine's monotonic clock) its heartbeat's count last moved}."""
    started_again: dict = dataclasses.field(default_factory=dict)
    """{node rank: (when, by this machine's monotonic clock; its new launcher's first heartbeat)} of the nodes whose
    launcher stopped and a new one joined while the job ran (its heartbeat's count began anew), lost first or not."""
    _beat_stop: threading.Event | None = None
    _beat_thread: threading.Thread | None = None
    _place: bytes | None = None
    """What this node wrote into its place (``place/<node rank>``), where it took one on joining."""

    @property
    def beat_interval_s(self) -> float:
        """How often this node posts its heartbeat and reads the others' (four reads within the deadline)."""
        return min(BEAT_S, self.beat_deadline_s / 4)

    @property
    def elastic(self) -> bool:
        return self.min_nodes is not None and self.min_nodes < self.nnodes

    @property
    def connected(self) -> bool:
        return self._store is not None

    def connect(self, join_timeout_s: float | None = None) -> tuple[object, str | None]:
        """The store (opened on the first call: bound here on the node hosting it, else connected to once it
        answers, within ``join_timeout_s``) and the address it listens on (None for a client)."""
        if self._store is None:
            from multigpu.launch.rendezvous import parse_endpoint
            from multigpu.launch.stores import open_store

            host, port = parse_endpoint(self.endpoint, nnodes=self.nnodes)
            self._store, self._address = open_store(host, port, is_host=self.hosts_store,
                                                    read_timeout=self.read_timeout_s,
                                                    join_timeout=join_timeout_s or self.join_timeout_s)
            if self.hosts_store is None:
                self.hosts_store = self._address is not None
            if self.node_rank is None:
                self.node_rank = self._take_place(join_timeout_s or self.join_timeout_s)
        return self._store, self._address

    def _take_place(self, timeout_s: float) -> int:
        """This node's index, where none was given: 0 for the node hosting the store, else the lowest free place of
        1..nnodes-1 (``compare_set``: one node a place), waiting for one to be given back (a node that ended or was
        found lost) within ``timeout_s``."""
        from multigpu.launch.stores import seal

        mine = seal(self.secret, secrets.token_bytes(16))
        if self.hosts_store:
            self.store.set(self._key("place/0"), mine)
            self._place = mine
            return 0
        deadline = time.monotonic() + timeout_s
        while True:
            self.raise_if_failed()
            for node in range(1, self.nnodes):
                if self.store.compare_set(self._key(f"place/{node}"), "", mine) == mine:
                    self._place = mine
                    return node
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"every place of the job's {self.nnodes} nodes (--nnodes {self.nnodes}) was taken at "
                    f"{self.endpoint} for {timeout_s:g}s: more nodes than --nnodes were started with this endpoint "
                    "and --rdzv-id, or a node that stopped has not been found lost yet")
            time.sleep(_POLL_S)

    def give_back(self, node: int) -> None:
        """Free ``node``'s place (it ended, or was found lost) for the next node that joins: only where places are
        taken (no node ranks were given), and only the place as it is now (never one taken meanwhile)."""
        key = self._key(f"place/{node}")
        with contextlib.suppress(Exception):  # noqa: BLE001 - a store gone has no places left to give
            if node == 0 or not self.store.check([key]):
                return
            held = self._place if node == self.node_rank else self.store.get(key)
            if held:
                self.store.compare_set(key, held, b"")

    @property
    def store(self):
        return self.connect()[0]

    def store_answers(self, within_s: float = 3.0) -> bool:
        """Whether the rendezvous store answers at the endpoint now (or this launcher holds it), within
        ``within_s``: never waits for it as joining does."""
        if self.connected:
            return True
        from multigpu.launch.rendezvous import parse_endpoint
        from multigpu.launch.stores import wait_for_store

        try:
            wait_for_store(*parse_endpoint(self.endpoint, nnodes=self.nnodes), within_s)
        except (MultigpuError, OSError):
            return False
        return True

    # ------------------------------------------------------------------ signed values
    def _key(self, name: str) -> str:
        return f"{_PREFIX}{self.run_id}/{name}"

    def _set(self, name: str, value: object, via: object = None) -> None:
        from multigpu.launch.stores import seal

        (via or self.store).set(self._key(name), seal(self.secret, json.dumps(value).encode()))

    def _get(self, name: str, via: object = None) -> object | None:
        """The value of ``name`` (over the connection ``via``, else the session's), or None while it is not set
        (never blocks)."""
        from multigpu.launch.stores import unseal

        store, key = via or self.store, self._key(name)
        if not store.check([key]):
            return None
        return json.loads(unseal(self.secret, store.get(key), f"value {name!r}", key=key, where=self.endpoint).decode())

    def beat_store(self):
        """The heartbeat's own connection to the store, opened on the first call. Not the session's: torch's agent
        waits on that one in its exit barrier (until every node's ranks ended, up to 300 s) and a connection serves
        one call at a time, so a node whose ranks had finished first sent no heartbeat while the others worked on,
        and they took it for lost."""
        if self._beat_client is None:
            from multigpu.launch.stores import another_client

            self._beat_client = another_client(self.store, self.read_timeout_s)
        return self._beat_client

    def failure(self) -> dict | None:
        """What another node posted when it failed before the job formed (node, host, reason), or None."""
        found = self._get("failed")
        return found if isinstance(found, dict) and found.get("node") != self.node_rank else None

    def raise_if_failed(self) -> None:
        if not self.connected:
            return
        found = self.failure()
        if found is not None:
            self._ack()
            raise NodeFailedError(describe(found))

    # ------------------------------------------------------------------ agreement
    def _wait(self, name: str, what: str) -> object:
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            self.raise_if_failed()
            value = self._get(name)
            if value is not None:
                return value
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"node {self.node_rank} waited {self.join_timeout_s:g}s at {self.endpoint} for {what}; start "
                    "node 0 (--node-rank 0) with the same command, --nnodes and --rdzv-endpoint") from None
            time.sleep(_POLL_S)

    def agree(self, name: str, decide: Callable[[], str]) -> str:
        """Node 0 calls ``decide`` and tells the others; they wait for it (and stop if a node failed)."""
        if self.node_rank == 0:
            value = decide()
            self._set(f"value/{name}", value)
            return value
        return str(self._wait(f"value/{name}", f"node 0 to settle the {name.replace('_', ' ')}"))

    def check_shared(self, folder: Path, what: str = "run folder") -> None:
        """Every node sees ``folder`` as one folder: node 0 writes a marker there, every other node must find it
        in its own ``folder``; node 0 waits until each did, then removes it.

        An elastic job (``--nnodes MIN:MAX``): node 0 waits only for the nodes the job cannot start without (node
        ranks below MIN), and keeps its marker until it leaves, for the nodes that join later.

        Raises:
            ConfigError: this node does not see node 0's marker ("the run folder is not shared between nodes").
        """
        if self.node_rank == 0:
            token = secrets.token_hex(8)
            marker = folder / f"{_MARKER}{token}"
            marker.write_text(f"{self.host}\n")
            self._set("shared/token", token)
            try:
                for rank in range(1, self.min_nodes if self.elastic else self.nnodes):
                    self._wait(f"shared/seen/{rank}", f"node {rank} to find the {what}")
            except BaseException:
                with contextlib.suppress(OSError):
                    marker.unlink()
                raise
            if self.elastic:
                self._marker = marker  # removed when this node leaves (joined's end)
            else:
                with contextlib.suppress(OSError):
                    marker.unlink()
            return
        token = self._wait("shared/token", f"node 0 to make the {what}")
        where = folder if folder.is_absolute() else f"{folder} (in {Path.cwd()})"
        if not (folder / f"{_MARKER}{token}").is_file():
            seen = "does not exist" if not folder.is_dir() else "exists but does not hold node 0's marker"
            raise ConfigError(f"the {what} is not shared between nodes: node 0 made {folder} and marked it, but on "
                              f"node {self.node_rank} ({self.host}) {where} {seen}; valid: a --run-dir on a file "
                              "system every node mounts at the same path (NFS, Lustre, a ReadWriteMany volume), "
                              "started from the same working directory")
        self._set(f"shared/seen/{self.node_rank}", True)

    # ------------------------------------------------------------------ heartbeats
    def start_beats(self, steps_dir: str, on_lost: Callable[[int], None]) -> None:
        """Post this node's heartbeat and watch the others' in a thread until :meth:`stop_beats`; ``on_lost(node)``
        is called (in that thread) once for each node found lost (:func:`lost_line` says it)."""
        if self._beat_thread is not None:
            return
        self._beat_stop = threading.Event()
        self._beat_thread = threading.Thread(target=_beat_loop, args=(self, steps_dir, on_lost),
                                             name="multigpu-node-heartbeat", daemon=True)
        self._beat_thread.start()

    def stop_beats(self, why: str) -> None:
        """Stop the heartbeat and say this node ended (``why``), so that no other node takes it for lost."""
        if self._beat_thread is None:
            return
        self._beat_stop.set()
        self._beat_thread.join(timeout=5)
        self._beat_thread = None
        if not self.connected:
            return  # never opened: no other node heard of this one
        with contextlib.suppress(Exception):  # noqa: BLE001 - the store may be gone
            self._set(f"beat/{self.node_rank}", {"end": why, "host": self.host})
        if self._place is not None:
            self.give_back(self.node_rank)

    def stop_together(self, within_s: float = STOP_TOGETHER_S) -> None:
        """After this node's ranks stopped at the scheduler's warning: say so in the store, and wait until every
        other node's ranks stopped too (its launcher said so, or ended), at most ``within_s``; the node hosting the
        store waits until the other launchers ended (they read and write it to the end: a store gone under them
        prints torch's C++ warnings). Under SLURM the first launcher to exit with a code other than 0 ends the
        whole step (``srun --kill-on-bad-exit``): a node whose ranks stopped at once must not cut off rank 0 while
        it writes the step's checkpoint and says where."""
        if not self.connected:
            return

        def stopped(node: int) -> bool:
            return bool(self._get(f"stopped/{node}")) or self._ended(node)

        done = self._ended if self.hosts_store else stopped
        deadline = time.monotonic() + within_s
        try:
            self._set(f"stopped/{self.node_rank}", True)
            while time.monotonic() < deadline:
                if all(done(node) for node in range(self.nnodes) if node != self.node_rank):
                    return
                time.sleep(_POLL_S)
        except Exception:  # noqa: BLE001 - the store is gone: node 0's launcher ended, and with it its ranks
            return

    def _ended(self, node: int) -> bool:
        """Node ``node``'s launcher said in the store that it ended (:meth:`stop_beats`)."""
        beat = self._get(f"beat/{node}")
        return isinstance(beat, dict) and bool(beat.get("end"))

    def wait_lost(self, within_s: float) -> list[int]:
        """The nodes found lost, waiting up to ``within_s`` for the heartbeat to find one (after the job's
        ranks failed: a node that died takes up to ``beat_deadline_s`` to be known as lost)."""
        deadline = time.monotonic() + within_s
        while not self.lost and self._beat_thread is not None and time.monotonic() < deadline:
            if all(self._beats.get(node, {}).get("end") for node in range(self.nnodes) if node != self.node_rank):
                break  # every other node ended as it should: none is lost
            time.sleep(_POLL_S)
        return sorted(self.lost)

    def verdict(self, since: float, within_s: float) -> dict[int, tuple[str, str]]:
        """After this node's ranks lost a peer at ``since`` (``time.monotonic()``): the other nodes that caused it,
        each as (in short, its whole line): found lost (``node 1 (gpu7), lost``; :func:`lost_line`), or started
        again (a new launcher joined before the old one was found lost: :func:`started_again_line`). Waits until every other node is either of those, heard from
        after ``since`` (its launcher lives: the cause is a rank of its own, which its output names) or ended; at
        most ``within_s``. A node started again up to a heartbeat deadline before ``since`` counts: its ranks died
        with the old launcher, before this node's ranks noticed."""
        deadline = time.monotonic() + within_s
        others = [node for node in range(self.nnodes) if node != self.node_rank]

        def again(node: int) -> bool:
            return self.started_again.get(node, (-1.0,))[0] > since - self.beat_deadline_s

        # a beat read within one read interval after ``since`` may have been posted before it (a killed node's
        # last): only a later one is a sign of life
        alive_after = since + self.beat_interval_s + _POLL_S
        while self._beat_thread is not None and time.monotonic() < deadline:
            if all(node in self.lost or again(node) or self._heard.get(node, -1.0) > alive_after
                   or self._beats.get(node, {}).get("end") for node in others):
                break
            time.sleep(_POLL_S)
        causes = {node: (f"node {node} ({self.lost[node].get('host', 'unknown host')}), lost", lost_line(self, node))
                  for node in sorted(self.lost)}
        for node in others:
            if again(node) and node not in causes:
                host = self.started_again[node][1].get("host", "unknown host")
                causes[node] = (f"node {node} ({host}), started again", started_again_line(self, node))
        return dict(sorted(causes.items()))

    # ------------------------------------------------------------------ failure
    def _ack(self) -> None:
        with contextlib.suppress(Exception):  # noqa: BLE001 - a store already gone has nobody left to tell
            self._set(f"ack/{self.node_rank}", True)

    def tell(self, reason: str, *, linger: bool = True, reach: bool = True) -> None:
        """Say in the store that this node stopped before the job formed (the first failure wins), close
        torch's rendezvous so that the nodes waiting in it stop, and, on the node hosting the store, keep it
        open until every other node has read why (at most :data:`LINGER_S`). ``reach=False`` (Ctrl-C): tell only
        over a store already open, waiting for nothing."""
        from multigpu.launch.stores import seal

        if self.told:
            return
        self.told = True
        if self.elastic and not self.hosts_store and self.node_rank != 0:
            return  # an elastic job goes on without this node: nobody waits for it, nothing is closed
        if not self.connected and (not reach or not self._reach()):
            return
        mine = seal(self.secret, json.dumps({"node": self.node_rank, "host": self.host,
                                             "reason": reason}).encode())
        with contextlib.suppress(Exception):  # noqa: BLE001 - best effort: the store may be gone
            self.store.compare_set(self._key("failed"), "", mine)
            self._close_rendezvous()
        self._ack()
        if self.hosts_store and linger:
            self._linger()

    def _reach(self) -> bool:
        """Open the store to tell a failure: at once on the node hosting it; on another, if node 0 answers
        within :data:`TELL_CONNECT_S` (it may not have started, or have stopped already)."""
        from multigpu.launch.rendezvous import addresses, parse_endpoint

        with contextlib.suppress(MultigpuError, OSError, RuntimeError, ValueError):
            if not self.hosts_store:
                addresses(*parse_endpoint(self.endpoint, nnodes=self.nnodes))  # a name that does not resolve: no
            self.connect(join_timeout_s=TELL_CONNECT_S)
            return True
        return False

    def _close_rendezvous(self) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

        from multigpu.launch import stores

        params = RendezvousParameters(backend=stores.BACKEND, endpoint=self.endpoint, run_id=self.run_id,
                                      min_nodes=self.min_nodes or self.nnodes, max_nodes=self.nnodes)
        backend = stores.SignedBackend(C10dRendezvousBackend(self.store, self.run_id), self.secret, self.endpoint)
        create_handler(self.store, backend, params).set_closed()

    def _linger(self, why: str = "failed before the job formed", *, ended: bool = False) -> None:
        """Keep the store (this node hosts it) open until every other node has read why this one stops: it acked
        (:meth:`_ack`), or, with ``ended``, its launcher ended (its heartbeat says so); at most :data:`LINGER_S`."""
        deadline = time.monotonic() + LINGER_S
        said = False

        def done(rank: int) -> bool:
            return bool(self._get(f"ack/{rank}")) or (ended and self._ended(rank))

        while time.monotonic() < deadline:
            try:
                if all(done(rank) for rank in range(self.nnodes) if rank != self.node_rank):
                    return
            except Exception:  # noqa: BLE001 - nothing more can be read
                return
            if not said and time.monotonic() > deadline - LINGER_S + 3:
                print(f"multigpu: node {self.node_rank} {why}; keeping the rendezvous store "
                      f"open up to {LINGER_S:g}s for the other nodes to read why", file=sys.stderr, flush=True)
                said = True
            time.sleep(_POLL_S)

    def linger_until_ended(self, why: str) -> None:
        """On the node hosting the store, which stops for a reason every node finds in the store itself (the
        rendezvous state someone else wrote: :func:`multigpu.launch.stores.tampered`): keep the store open until
        every other node's launcher ended (at most :data:`LINGER_S`), so that none takes this node for lost."""
        if self.hosts_store and self.connected:
            self._linger(why, ended=True)


# ---------------------------------------------------------------------- heartbeats while the job runs
def _beat_loop(session: Nodes, steps_dir: str, on_lost: Callable[[int], None]) -> None:
    """Every :data:`BEAT_S`: post this node's heartbeat (a count, its host, the steps its ranks finished) and read
    the others'; a node whose count stood still for ``beat_deadline_s`` without saying it ended is lost."""
    from multigpu.runtime import progress

    count, interval = 0, session.beat_interval_s
    seen: dict[int, tuple[int, float]] = {}  # node -> (its count, when it last changed, by this clock)
    stop = session._beat_stop
    while not stop.is_set():
        if not session.connected:  # torch's rendezvous opens the store (or has not yet): nothing to say over
            stop.wait(interval)
            continue
        now = time.monotonic()
        count += 1
        try:
            via = session.beat_store()
        except Exception:  # noqa: BLE001 - the store is unreachable: nobody's beat arrives
            via = None
        with contextlib.suppress(Exception):  # noqa: BLE001 - a store gone with node 0: its beat stops below
            mine = {"n": count, "host": session.host, "steps": {str(r): s for r, s in progress.read(steps_dir).items()}}
            session._set(f"beat/{session.node_rank}", mine, _reachable(via))
            session._beats[session.node_rank] = mine
        for node in range(session.nnodes):
            if node == session.node_rank:
                continue
            try:
                beat = session._get(f"beat/{node}", _reachable(via))
            except Exception:  # noqa: BLE001 - the store is unreachable: nobody's beat arrives
                beat = None
            if node in session.lost:
                # an elastic job's lost node that joined again (a new launcher, counting from 1): watched again
                if not (isinstance(beat, dict) and not beat.get("end") and beat.get("n") != session.lost[node].get("n")):
                    continue
                session.started_again[node] = (now, beat)
                del session.lost[node]
                seen.pop(node, None)
            if isinstance(beat, dict):
                if beat.get("end"):
                    seen.pop(node, None)
                    session._beats[node] = {**session._beats.get(node, {}), "end": beat["end"]}
                    continue
                session._beats[node] = beat
                before = seen.get(node, (None,))[0]
                if isinstance(before, int) and isinstance(beat.get("n"), int) and beat["n"] < before:
                    session.started_again[node] = (now, beat)  # a new launcher there, before it was found lost
                if before != beat.get("n"):
                    seen[node] = (beat.get("n"), now)
                    session._heard[node] = now
            if node in seen and now - seen[node][1] > session.beat_deadline_s:
                session.lost[node] = session._beats.get(node, {})
                seen.pop(node)
                session.give_back(node)  # where nodes take places: the next node to join may take its place
                on_lost(node)
        stop.wait(interval)


def _reachable(via: object):
    if via is None:
        raise ConnectionError("the rendezvous store does not answer")
    return via


def lost_line(session: Nodes, node: int) -> str:
    """One line naming a lost node, how long it was silent, and the last step each rank of the job finished."""
    beat = session.lost.get(node, {})
    steps: dict[int, int] = {}
    for other in session._beats.values():
        steps.update({int(r): int(s) for r, s in (other.get("steps") or {}).items()})
    theirs = sorted(int(r) for r in (beat.get("steps") or {}))
    ranks = f" (rank{'s' if len(theirs) > 1 else ''} {', '.join(map(str, theirs))})" if theirs else ""
    finished = ("; last step finished: " + ", ".join(f"rank {r}: {steps[r]}" for r in sorted(steps))) if steps \
        else "; no rank had finished a step"
    return (f"node {node} ({beat.get('host', 'unknown host')}){ranks} was lost: its launcher sent no heartbeat for "
            f"{session.beat_deadline_s:g}s (--rdzv-conf keep_alive_interval x keep_alive_max_attempt){finished}")


def started_again_line(session: Nodes, node: int) -> str:
    """One line naming a node whose launcher stopped and a new one joined while the job ran."""
    beat = session.started_again.get(node, (0.0, {}))[1]
    return (f"node {node} ({beat.get('host', 'unknown host')}) started again: its launcher stopped and a new one "
            "joined (its heartbeat began anew) before it was found lost")


def store_gone(session: Nodes | None) -> bool:
    """This node (not the store's host) can no longer reach the rendezvous store: the node hosting it (node 0's
    launcher, unless ``is_host`` says otherwise) is gone. Never blocks on a live store (a ``check``)."""
    if session is None or session.hosts_store or not session.connected:
        return False
    try:
        session.store.check([session._key("beat/0")])
    except Exception:  # noqa: BLE001 - a reset, a broken pipe, a closed store: all say the same
        return True
    return False


def store_lost_line(session: Nodes, hosted_by_node0: bool) -> str:
    """One line: the rendezvous store stopped answering (with node 0, where it lives), so the job ends, elastic
    or not; the last step each rank finished."""
    steps: dict[int, int] = {}
    for other in session._beats.values():
        steps.update({int(r): int(s) for r, s in (other.get("steps") or {}).items()})
    finished = ("; last step finished: " + ", ".join(f"rank {r}: {steps[r]}" for r in sorted(steps))) if steps \
        else ""
    fewest = f", also with --nnodes {session.min_nodes}:{session.nnodes}" if session.elastic else ""
    if hosted_by_node0:
        host = session._beats.get(0, {}).get("host", "unknown host")
        what = (f"node 0 ({host}) was lost, and with it the rendezvous store its launcher hosts at {session.endpoint} "
                "(torch's c10d store lives on node 0)")
    else:
        what = f"the rendezvous store at {session.endpoint} stopped answering"
    return f"{what}: the job cannot go on without it{fewest}{finished}"


def describe(found: dict) -> str:
    """One line naming the node that failed and why."""
    return (f"node {found.get('node')} ({found.get('host')}) stopped before the job formed: "
            f"{str(found.get('reason', '')).removeprefix('error: ')}")


def open_session(run_id: str) -> Nodes | None:
    """This launcher's open session for the rendezvous ``run_id`` (None: it has none, e.g. on one node)."""
    return _sessions.get(run_id)


def posted_failure(run_id: str) -> str | None:
    """Another node's failure, as one line, when this launcher's session for ``run_id`` finds one (else None).
    Read by the launcher when torch's rendezvous stops (it was closed by the node that failed)."""
    session = _sessions.get(run_id)
    if session is None or not session.connected:
        return None
    try:
        found = session.failure()
    except Exception:  # noqa: BLE001 - the store may be gone with node 0
        return None
    if found is None:
        return None
    session.told = True  # a consequence: this node does not post its own
    session._ack()
    return describe(found)


def _session(cfg) -> Nodes:
    from multigpu.launch.rendezvous import hosts_store, parse_endpoint, secret_from_env
    from multigpu.launch.stores import hand_over

    parse_endpoint(cfg.rdzv_endpoint, nnodes=cfg.nnodes)
    session = Nodes(secret_from_env(cfg.nnodes), job_run_id(cfg.run_id, cfg.nnodes), cfg.nnodes, cfg.node_rank,
                    hosts_store(cfg.nnodes, cfg.node_rank, cfg.rdzv_conf), _seconds(cfg.rdzv_conf, "join_timeout", 600),
                    socket.gethostname(), cfg.rdzv_endpoint, _seconds(cfg.rdzv_conf, "read_timeout", 60),
                    getattr(cfg, "min_nodes", None),
                    beat_deadline_s=_seconds(cfg.rdzv_conf, "keep_alive_interval", 5)
                    * _seconds(cfg.rdzv_conf, "keep_alive_max_attempt", 3))
    _sessions[session.run_id] = session
    hand_over(session.run_id, session.connect)  # torch's rendezvous handler takes this session's store
    return session


@contextlib.contextmanager
def joined(cfg) -> Iterator[Nodes | None]:
    """This node among the job's launchers, for the ``with`` block (None on one node). Reentrant: an inner
    ``joined`` for the same job yields the open session. An error raised in the block before the job formed
    is told to the other nodes (:meth:`Nodes.tell`), unless it was another node's."""
    from multigpu.launch.stores import formed, release

    if cfg.nnodes == 1:
        yield None
        return
    run_id = job_run_id(cfg.run_id, cfg.nnodes)
    if run_id in _sessions:
        yield _sessions[run_id]
        return
    session = _session(cfg)
    try:
        if session.node_rank is None:  # torchrun's elastic form: the node learns its index by joining
            session.connect()
        yield session
    except (MultigpuError, KeyboardInterrupt, Exception) as exc:
        if not isinstance(exc, NodeFailedError) and not formed(run_id):
            interrupted = _interrupted(exc)  # Ctrl-C or a signal stops at once: no waiting to tell anyone
            session.tell(_reason(exc), linger=not interrupted, reach=not interrupted)
        raise
    finally:
        if session._marker is not None:
            with contextlib.suppress(OSError):
                session._marker.unlink()
        _sessions.pop(run_id, None)
        release(run_id)


def placed(cfg, session: Nodes | None):
    """``cfg`` with this node's index as the job's session settled it (the same ``cfg`` where it was given)."""
    if session is None or cfg.node_rank == session.node_rank:
        return cfg
    return dataclasses.replace(cfg, node_rank=session.node_rank)


def _interrupted(exc: BaseException) -> bool:
    from multigpu.errors import InterruptedBySignalError

    return isinstance(exc, (KeyboardInterrupt, InterruptedBySignalError))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return text if isinstance(exc, MultigpuError) else f"{type(exc).__name__}: {text}"


def tell_others(cfg, exc: BaseException) -> None:
    """Best effort, for a failure before this node's session began (its endpoint check): say why in the store,
    so that the other nodes do not wait for a node that has stopped. Nothing is said where the store cannot be
    opened here or reached, or the secret is missing."""
    from multigpu.launch.stores import release

    if cfg.nnodes == 1 or job_run_id(cfg.run_id, cfg.nnodes) in _sessions:
        return
    with contextlib.suppress(MultigpuError, OSError, RuntimeError, ValueError):
        session = _session(cfg)
        try:
            interrupted = _interrupted(exc)
            session.tell(_reason(exc), linger=not interrupted, reach=not interrupted)
        finally:
            _sessions.pop(session.run_id, None)
            release(session.run_id)
