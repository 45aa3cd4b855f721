"""Where the job's stores listen: the rendezvous store and the workers' store (runs in the launcher).

torch's c10d rendezvous makes its TCPStore servers itself, and a TCPStore server
listens on every interface (``*:PORT``, IPv4 and IPv6) whatever host name it is
given; the store has no authentication. torch's one public way to choose the
address is ``TCPStore(..., master_listen_fd=fd)`` with a socket the caller has
bound. So multigpu registers a rendezvous backend of its own, ``multigpu``, in
torch's handler registry: torch's own dynamic (c10d) rendezvous handler, built
by torch's ``create_handler``, on a store made here. Then:

* on several nodes the rendezvous store listens only on the address
  ``--rdzv-endpoint`` names. The other nodes connect to it as clients, after
  waiting for it in a Python loop that Ctrl-C stops at once (torch's client
  retries its connection in C++ and ignores Ctrl-C until its timeout). On one
  node it listens nowhere (a FileStore, below);
* the workers' store (their ``MASTER_ADDR:MASTER_PORT``) is hosted by the
  launcher that holds group rank 0, a fresh one for every rendezvous round (a
  restarted group never reads the previous attempt's keys:
  https://github.com/pytorch/pytorch/issues/135712),
  on the endpoint's address on one node (loopback for ``localhost:0``) and, on
  several, on this node's address on the route to the endpoint. Every worker is a client of it (``use_agent_store``), so no worker
  listens for a store, whatever the user's script calls.

The launcher sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which keeps torch's
handler from opening its own shared store on ``*``. Torch still finds a free
port for a store it then does not open (``get_free_port``: a socket bound to
``*`` and closed at once).

No one else on the machine (or the network) may run code through the stores.
torch's handler unpickles the rendezvous state it reads from the
store on every sync, and a TCPStore has no authentication: whoever can connect
can list its keys (``list_keys``) and write any of them. So:

* on one node the rendezvous store is a ``FileStore`` in a folder only this user
  can open (``mkdtemp``: 0700), removed when the handler shuts down: nothing
  listens for it;
* every state blob is signed (HMAC-SHA256) with a secret that never goes
  through the store (:class:`SignedBackend`), and a blob whose signature does
  not match is refused before torch unpickles it, in one line naming tampering.
  On one node the secret is random and lives only in the launcher's memory; on
  several, every node reads the same one from ``MULTIGPU_RDZV_SECRET``
  (:func:`secret_from_env`; the workers do not inherit it). The address of the
  workers' store is signed the same way, so no one sends a node's workers to a
  store of theirs.

Two waits of torch's handler are cut, which made a one-node job's rendezvous take 0.15 s on average (up to
0.3 s): the random sleep before a first round ("to skew the attempts across the nodes") is skipped on one node,
and the caller's name in its event records is read from the frame instead of ``inspect.stack()`` (which reads
every frame's source).

What remains: the workers' store is a TCPStore (torch's workers reach it through
``MASTER_ADDR:MASTER_PORT``; torch offers no other store there), on loopback on
one node, so local users can connect to it, read its keys and disturb the job.
torch reads nothing from it with pickle (gloo and NCCL addresses, barrier
counters); the agent's rank assignment in the rendezvous store is JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta

from torch.distributed import FileStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    dynamic_rendezvous,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token, create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from multigpu.errors import ConfigError, RendezvousTimeoutError
from multigpu.launch.quiet import without_noise
from multigpu.launch.rendezvous import SECRET_VAR, addresses, bind_address, secret_from_env

__all__ = ["BACKEND", "SECRET_VAR", "TAMPERED", "SignedBackend", "formed", "hand_over", "open_store", "refusal",
           "register", "release", "secret_from_env", "seal", "tampered", "unseal", "wait_for_store", "where_is"]

BACKEND = "multigpu"
"""The rendezvous backend name given to torch's agent."""

TAMPERED = "was not written by this job (its signature does not match)"
"""In the one line that refuses a rendezvous value: someone else wrote to the store, or the nodes hold different
``MULTIGPU_RDZV_SECRET`` values."""

_WORKER_STORE_KEY = "multigpu/worker_store"
_RETRY_S = 0.5
_secrets: dict[str, tuple[bytes, str | None]] = {}  # run id -> (secret, private folder), kept by register()
_backends: dict[str, RendezvousBackend] = {}  # run id -> this launcher's signed backend (read again by tampered())
_opened: dict[str, Callable[[], tuple[Store, str | None]]] = {}  # run id -> multigpu.launch.nodes' store
_formed: set[str] = set()  # run ids whose first rendezvous round completed on this node (the job formed)


def _mac(secret: bytes, data: bytes) -> bytes:
    return hmac.new(secret, data, hashlib.sha256).digest()


def _seal(secret: bytes, data: bytes) -> bytes:
    return _mac(secret, data) + data


def seal(secret: bytes, data: bytes) -> bytes:
    """``data`` signed with ``secret`` (what :func:`unseal` checks)."""
    return _seal(secret, data)


def unseal(secret: bytes, blob: bytes, what: str, *, key: str = "", where: str = "") -> bytes:
    """``blob``'s data once its signature matches ``secret``; RendezvousStateError (naming ``what``, the store's
    ``key`` and the store's address ``where``) otherwise."""
    return _open(secret, blob, what, key, where)


def refusal(what: str, key: str = "", where: str = "") -> RendezvousStateError:
    """The one line that refuses a value of the rendezvous store: the ``what`` at ``key`` in the store at
    ``where`` was written by someone else."""
    at = f" (key {key} in the rendezvous store at {where})" if key and where else (
        f" (key {key} in the rendezvous store)" if key else " in the rendezvous store")
    return RendezvousStateError(
        f"the {what}{at} {TAMPERED}: another process wrote to the store (tampering), or the nodes were started "
        f"with different {SECRET_VAR} values; nothing it held was read")


def _open(secret: bytes, blob: bytes, what: str, key: str = "", where: str = "") -> bytes:
    """``blob`` without its signature; refused (before anything reads it) when the signature does not match."""
    mac, data = blob[:32], blob[32:]
    if len(blob) < 32 or not hmac.compare_digest(mac, _mac(secret, data)):
        raise refusal(what, key, where)
    return data


def where_is(store: Store, fallback: str = "") -> str:
    """A store's address as a line names it: ``host:port`` of a TCPStore, the file of a FileStore."""
    with contextlib.suppress(Exception):  # noqa: BLE001 - a store of another kind, or gone: the fallback says it
        if isinstance(store, TCPStore):
            return f"{store.host}:{store.port}"
        if isinstance(store, FileStore):
            return f"file {store.path}"
    return fallback


class SignedBackend(RendezvousBackend):
    """torch's c10d backend with every state blob signed: torch's handler unpickles only what this job wrote.

    Whatever else the state's key holds was written by someone else, whether or not torch's backend can decode
    it (a value that is not base64 is "The state object is corrupt" there): each is refused as tampering, naming
    the store's address (``where``) and the key."""

    def __init__(self, inner: C10dRendezvousBackend, secret: bytes, where: str = ""):
        self._inner = inner
        self._secret = secret
        self._key = getattr(inner, "_key", "")  # torch's: "torch.rendezvous.<run id>"
        self._where = where or where_is(getattr(inner, "_store", None))

    @property
    def name(self) -> str:
        return self._inner.name

    def _refused(self) -> RendezvousStateError:
        return refusal("rendezvous state", self._key, self._where)

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            got = self._inner.get_state()
        except RendezvousStateError:  # not base64: torch's backend wrote none of it
            raise self._refused() from None
        return None if got is None else (self._unsealed(got[0]), got[1])

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        # what comes back is the store's value, ours or another writer's: checked alike
        try:
            got = self._inner.set_state(_seal(self._secret, state), token)
        except RendezvousStateError:
            raise self._refused() from None
        if got is None:
            return None
        blob, new_token, has_set = got
        return self._unsealed(blob), new_token, has_set

    def _unsealed(self, blob: bytes) -> bytes:
        try:
            return _open(self._secret, blob, "rendezvous state")
        except RendezvousStateError:
            raise self._refused() from None


def _listening_store(host: str, port: int, timeout_s: float) -> tuple[TCPStore, str]:
    sock, address = bind_address(host, port)
    bound_port = sock.getsockname()[1]
    with without_noise():  # the store's own client connects to it: torch's reverse-DNS line, where none answers
        store = TCPStore(address, bound_port, is_master=True, wait_for_workers=False, multi_tenant=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach(), use_libuv=True)
    return store, address


def another_client(store: TCPStore, timeout_s: float) -> TCPStore:
    """A second connection to the store ``store`` talks to (its host and port). A store's connection serves one
    call at a time: a thread that must not wait behind another's blocking call (torch's exit barrier waits on
    the store up to 300 s) talks over a connection of its own."""
    with without_noise():
        return TCPStore(store.host, store.port, is_master=False, timeout=timedelta(seconds=timeout_s))


def _address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent)."""
    family, kind, proto, _, address = addresses(host, port or 1, socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as sock:
        sock.connect(address)
        return sock.getsockname()[0]


def wait_for_store(host: str, port: int, timeout_s: float) -> None:
    """Return once ``host:port`` accepts a connection; Ctrl-C stops the wait at once.

    Raises:
        RendezvousTimeoutError: nothing accepted within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(timeout_s, 0.1))):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RendezvousTimeoutError(
                    f"no rendezvous store answered at {host}:{port} within {timeout_s:g}s; start node 0 "
                    "(--node-rank 0) with the same --rdzv-endpoint, or check the address") from None
            time.sleep(_RETRY_S)


@contextlib.contextmanager
def _no_join_skew() -> Iterator[None]:
    """torch's handler sleeps a random 0-0.3 s before a first round, "to skew the rendezvous attempts across the
    nodes" (``next_rendezvous``): one node has no other to skew against, and a job's start waited for it. Only that
    sleep (a range) is skipped; the others (a sync's poll) stay."""
    original = getattr(dynamic_rendezvous, "_delay", None)
    if original is None:  # another torch: nothing to skip
        yield
        return

    def delay(seconds) -> None:
        if not isinstance(seconds, tuple):
            original(seconds)

    dynamic_rendezvous._delay = delay
    try:
        yield
    finally:
        dynamic_rendezvous._delay = original


_TORCH_METHOD_NAME = getattr(dynamic_rendezvous, "get_method_name", None)
"""torch's own, which :func:`register` replaces with :func:`_method_name`."""


def _method_name(depth: int = 2) -> str:
    """torch's ``get_method_name`` (the function ``depth`` frames up, for its event records) without
    ``inspect.stack()``, which reads the source lines of every frame of the stack, twice per record."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


class _WorkerStoreHandler(RendezvousHandler):
    """torch's handler, plus a workers' store per round that listens where this module says."""

    def __init__(self, inner: RendezvousHandler, worker_host: str | None, endpoint: tuple[str, int],
                 timeout_s: float, secret: bytes, private_dir: str | None = None, single_node: bool = False,
                 where: str = ""):
        self._inner = inner
        self._where = where  # the rendezvous store's address, as a refusal names it
        self._single_node = single_node
        self._worker_host = worker_host  # None: this node's address towards the endpoint, found when needed
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._secret = secret
        # the FileStore's folder (one node): removed at shutdown, or when the handler goes or the launcher exits
        # (torch's launcher skips shutdown() after a signal)
        self._remove_private_dir = weakref.finalize(self, shutil.rmtree, private_dir, True) if private_dir else None
        self._worker_store: TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # every worker is a client of the store below

    def next_rendezvous(self) -> RendezvousInfo:
        with _no_join_skew() if self._single_node else contextlib.nullcontext():
            info = self._inner.next_rendezvous()
        _formed.add(self.get_run_id())
        self._worker_store = None  # the previous round's server stops
        if info.rank == 0:
            host = self._worker_host or _address_towards(*self._endpoint)
            self._worker_store, address = _listening_store(host, 0, self._timeout_s)
            where = f"{address} {self._worker_store.port}"
            info.store.set(_WORKER_STORE_KEY, _seal(self._secret, where.encode()))
        else:  # signed: no one else sends this node's workers to a store of theirs
            where = _open(self._secret, info.store.get(_WORKER_STORE_KEY), "workers' store address",
                          self._round_key(_WORKER_STORE_KEY), self._where).decode()
        address, port = where.rsplit(" ", 1)
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(address, int(port)))

    def _round_key(self, key: str) -> str:
        """``key`` as the rendezvous store holds it: under this round's prefix (torch's ``_wrap_store``)."""
        state = getattr(getattr(self._inner, "_state_holder", None), "state", None)
        round_ = getattr(state, "round", "<round>")
        return f"torch.rendezvous.{self.get_run_id()}.{round_}/{key}"

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._worker_store = None
        try:
            return self._inner.shutdown()
        finally:
            if self._remove_private_dir:
                self._remove_private_dir()


def _file_store(timeout_s: float, parent: str | None) -> tuple[Store, str]:
    """One node: a FileStore in a fresh folder only this user can open (``mkdtemp`` makes it 0700), inside the
    launcher's private folder when it gave one (which the reaper removes if the launcher is killed)."""
    folder = tempfile.mkdtemp(prefix="multigpu_rdzv_", dir=parent)
    store = FileStore(os.path.join(folder, "store"), -1)
    store.set_timeout(timedelta(seconds=timeout_s))
    return store, folder


def open_store(host: str, port: int, *, is_host: bool | None, read_timeout: float, join_timeout: float
               ) -> tuple[Store, str | None]:
    """A multi-node job's rendezvous store: hosted here on the endpoint's own address (``is_host``), else a
    client of it once it answers (Ctrl-C stops the wait). ``is_host=None``: hosted here where this launcher can
    listen there, else a client (torchrun's rule: the endpoint is another machine's, or another launcher of this
    machine holds its port). Returns the store and the address it listens on (None for a client)."""
    if is_host or is_host is None:
        try:
            return _listening_store(host, port, read_timeout)
        except ConfigError:
            if is_host:
                raise
    wait_for_store(host, port, join_timeout)
    with without_noise():
        return TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=read_timeout)), None


def hand_over(run_id: str, store: Callable[[], tuple[Store, str | None]]) -> None:
    """The store of :mod:`multigpu.launch.nodes`' session (``store()`` opens it, once): the handler of ``run_id``
    uses it instead of opening another on the same port."""
    _opened[run_id] = store


def release(run_id: str) -> None:
    """Forget ``run_id``'s early store and rendezvous state (the session that opened it is over)."""
    _opened.pop(run_id, None)
    _formed.discard(run_id)


def formed(run_id: str) -> bool:
    """Whether the job of ``run_id`` has formed on this node (a rendezvous round completed)."""
    return run_id in _formed


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    is_host = params.get_as_bool("is_host", True)
    secret, parent = _secrets.get(params.run_id, (None, None))
    secret = secret or secret_from_env(params.max_nodes) or secrets.token_bytes(32)
    private_dir = None
    if params.max_nodes == 1 and is_host:  # no other node joins: no listener at all
        store, private_dir = _file_store(read_timeout, parent)
        address = addresses(host, port)[0][4][0]  # where the workers' store listens (loopback for localhost)
    elif params.run_id in _opened:
        store, address = _opened[params.run_id]()
    else:
        store, address = open_store(host, port, is_host=is_host, read_timeout=read_timeout,
                                    join_timeout=params.get_as_int("join_timeout", 600) or 600)
    # the endpoint as the user gave it, with the port the store listens on (port 0: the one it was given)
    where = f"file {store.path}" if private_dir else f"{host}:{getattr(store, 'port', port) or port}"
    backend = SignedBackend(C10dRendezvousBackend(store, params.run_id), secret, where)
    _backends[params.run_id] = backend
    handler = create_handler(store, backend, params)
    single_node = params.max_nodes == 1 and address is not None
    return _WorkerStoreHandler(handler, address if single_node else None, (host, port), read_timeout, secret,
                               private_dir, single_node=params.max_nodes == 1, where=where)


def tampered(run_id: str) -> RendezvousStateError | None:
    """The refusal of ``run_id``'s rendezvous state as the store holds it now, or None: signed by this job, or
    unreadable for another reason (the store gone with its node is not tampering).

    Several nodes: after a worker fails, the cause may be another node that stopped on a planted state before
    this node's agent read it again; the launcher asks here so that its last line names the cause."""
    backend = _backends.get(run_id)
    if backend is None:
        return None
    try:
        backend.get_state()
    except RendezvousStateError as exc:
        return exc if TAMPERED in str(exc) else None
    except Exception:  # noqa: BLE001 - a store that cannot be read says nothing about tampering
        return None
    return None


def register(run_id: str | None = None, secret: bytes | None = None, folder: str | None = None) -> None:
    """Make ``rdzv_backend="multigpu"`` known to torch's agent (idempotent), and keep ``run_id``'s secret (and the
    private folder where a one-node rendezvous store goes).

    torch's agent makes the handler in this process (the launcher), so the secret is handed over in memory:
    never on a command line, in a file, a log or the store. Without one, the handler takes
    ``MULTIGPU_RDZV_SECRET`` (several nodes: required) or, on one node, a random one.
    """
    rendezvous_handler_registry.register(BACKEND, _create_handler)
    if _TORCH_METHOD_NAME is not None:
        dynamic_rendezvous.get_method_name = _method_name
    if run_id is not None and secret is not None:
        _secrets[run_id] = (secret, folder)
