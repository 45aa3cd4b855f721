"""Where the job's stores listen: the rendezvous store and the workers' store (runs in the launcher).

torch's c10d rendezvous makes its TCPStore servers itself, and a TCPStore server
listens on every interface (``*:PORT``, IPv4 and IPv6) whatever host name it is
given; the store has no authentication. torch's one public way to choose the
address is ``TCPStore(..., master_listen_fd=fd)`` with a socket the caller has
bound. So multigpu registers a rendezvous backend of its own, ``multigpu``, in
torch's handler registry: torch's own dynamic (c10d) rendezvous handler, built
by torch's ``create_handler``, on a store made here. Then:

* the rendezvous store listens only on the address ``--rdzv-endpoint`` names
  (``localhost:0`` on one node: 127.0.0.1, a free port). The other nodes
  connect to it as clients, after waiting for it in a Python loop that Ctrl-C
  stops at once (torch's client retries its connection in C++ and ignores
  Ctrl-C until its timeout);
* the workers' store (their ``MASTER_ADDR:MASTER_PORT``) is hosted by the
  launcher that holds group rank 0, a fresh one for every rendezvous round (a
  restarted group never reads the previous attempt's keys: pytorch/pytorch#135712),
  on loopback on one node and, on several, on this node's address on the route to
  the endpoint. Every worker is a client of it (``use_agent_store``), so no worker
  listens for a store, whatever the user's script calls.

The launcher sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which keeps torch's
handler from opening its own shared store on ``*``. Torch still finds a free
port for a store it then does not open (``get_free_port``: a socket bound to
``*`` and closed at once).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from multigpu.errors import RendezvousTimeoutError
from multigpu.launch.rendezvous import addresses, bind_address

__all__ = ["BACKEND", "register", "wait_for_store"]

BACKEND = "multigpu"
"""The rendezvous backend name given to torch's agent."""

_WORKER_STORE_KEY = "multigpu/worker_store"
_RETRY_S = 0.5


def _listening_store(host: str, port: int, timeout_s: float) -> tuple[TCPStore, str]:
    sock, address = bind_address(host, port)
    bound_port = sock.getsockname()[1]
    store = TCPStore(address, bound_port, is_master=True, wait_for_workers=False, multi_tenant=False,
                     timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach(), use_libuv=True)
    return store, address


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


class _WorkerStoreHandler(RendezvousHandler):
    """torch's handler, plus a workers' store per round that listens where this module says."""

    def __init__(self, inner: RendezvousHandler, worker_host: str | None, endpoint: tuple[str, int],
                 timeout_s: float):
        self._inner = inner
        self._worker_host = worker_host  # None: this node's address towards the endpoint, found when needed
        self._endpoint = endpoint
        self._timeout_s = timeout_s
        self._worker_store: TCPStore | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # every worker is a client of the store below

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        self._worker_store = None  # the previous round's server stops
        if info.rank == 0:
            host = self._worker_host or _address_towards(*self._endpoint)
            self._worker_store, address = _listening_store(host, 0, self._timeout_s)
            info.store.set(_WORKER_STORE_KEY, f"{address} {self._worker_store.port}")
        address, port = info.store.get(_WORKER_STORE_KEY).decode().rsplit(" ", 1)
        return RendezvousInfo(info.store, info.rank, info.world_size, RendezvousStoreInfo(address, int(port)))

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
        return self._inner.shutdown()


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    if params.get_as_bool("is_host", True):
        store, address = _listening_store(host, port, read_timeout)
    else:
        wait_for_store(host, port, params.get_as_int("join_timeout", 600) or 600)
        store = TCPStore(host, port, is_master=False, multi_tenant=True, timeout=timedelta(seconds=read_timeout))
        address = None
    handler = create_handler(store, C10dRendezvousBackend(store, params.run_id), params)
    single_node = params.max_nodes == 1 and address is not None
    return _WorkerStoreHandler(handler, address if single_node else None, (host, port), read_timeout)


def register() -> None:
    """Make ``rdzv_backend="multigpu"`` known to torch's agent (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create_handler)
