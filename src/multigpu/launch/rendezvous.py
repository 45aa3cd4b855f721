"""The rendezvous endpoint: parsing, multi-node checks, and the address the store binds (runs in the launcher).

:func:`check_endpoint` runs before anything is written or started: the node that
hosts the rendezvous store (the only node of a single-node job; node 0 of a
multi-node job) must be able to listen on the endpoint's own address, since
the store listens there and nowhere else (:mod:`multigpu.launch.stores`).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket

from multigpu import envvars
from multigpu.errors import ConfigError

__all__ = ["SECRET_VAR", "addresses", "bind_address", "check_endpoint", "hosts_store", "is_loopback",
           "loopback_interface", "parse_endpoint", "secret_from_env"]

SECRET_VAR = envvars.RDZV_SECRET
"""The secret every node of a multi-node job signs the rendezvous state with (the same on every node)."""

_MIN_SECRET_CHARS = 16


def secret_from_env(nnodes: int, environ=os.environ) -> bytes | None:
    """The multi-node secret from ``MULTIGPU_RDZV_SECRET``; None on one node (a random one, in memory, is stronger).

    Raises:
        ConfigError: several nodes and no secret, or one short enough to guess.
    """
    if nnodes == 1:
        return None
    text = environ.get(SECRET_VAR, "")
    if len(text) < _MIN_SECRET_CHARS:
        said = "is not set" if not text else f"has {len(text)} characters"
        raise ConfigError(
            f"--nnodes {nnodes}: {SECRET_VAR} {said}; the rendezvous store is reachable over the network, so every "
            f"node signs what it writes there with this secret; valid: the same random value of at least "
            f"{_MIN_SECRET_CHARS} characters on every node, e.g. export {SECRET_VAR}=$(openssl rand -hex 16)")
    return text.encode()


def parse_endpoint(endpoint: str, *, nnodes: int) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6addr]:port``) and check it suits ``nnodes``.

    Port 0 ("pick a free one") only works on one node: the other nodes could not know it.
    """
    text = endpoint.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep:
            raise ConfigError(f"--rdzv-endpoint {endpoint!r} has an unclosed '['; valid: host:port or [v6addr]:port")
    else:
        host, _, port_text = text.rpartition(":")
        if not _:
            host, port_text = text, ""
    if not host or not port_text:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} needs a host and a port; valid: host:port, e.g. node0:29400")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(f"--rdzv-endpoint {endpoint!r} has port {port_text!r}; valid: a number from 0 to 65535")
    port = int(port_text)
    if nnodes > 1 and port == 0:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} with --nnodes {nnodes}: port 0 only works on one node; "
            "give every node the same host:port, e.g. node0:29400"
        )
    return host, port


def addresses(host: str, port: int, kind: int = socket.SOCK_STREAM) -> list[tuple]:
    """``getaddrinfo`` results for ``host``, IPv4 first (``localhost`` is 127.0.0.1 before ::1)."""
    infos = socket.getaddrinfo(host, port, type=kind)
    return sorted(infos, key=lambda info: info[0] != socket.AF_INET)


def _is_unspecified(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_unspecified
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def bind_address(host: str, port: int) -> tuple[socket.socket, str]:
    """A listening socket on ``host``'s own address (never ``*`` unless ``host`` says so) and that address.

    Raises:
        ConfigError: ``host`` does not resolve, is not an address of this machine, or the port is taken.
    """
    try:
        infos = addresses(host, port)
    except socket.gaierror as exc:
        raise ConfigError(f"'{host}' does not resolve on this machine ({exc.strerror})") from None
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own server does
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
            return sock, address[0]
        except OSError as exc:
            sock.close()
            error = error or exc
    address = infos[0][4][0] if infos else host
    if error is not None and error.errno == errno.EADDRINUSE:
        raise ConfigError(f"port {port} on {address} is already in use") from None
    reason = error.strerror if error is not None else "no address"
    raise ConfigError(f"cannot listen on {address} ({reason}): it is not an address of this machine") from None


def _as_bool(key: str, text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "y", "on"):
        return True
    if value in ("0", "false", "no", "n", "off"):
        return False
    raise ConfigError(f"--rdzv-conf {key}={text} is invalid; valid: true or false")


def hosts_store(nnodes: int, node_rank: int | None, rdzv_conf: dict[str, str]) -> bool | None:
    """Whether this node's launcher hosts the rendezvous store: node 0 (the only node of a single-node job),
    unless ``--rdzv-conf is_host=...`` says otherwise. None: no node rank was given (torchrun's elastic form), so
    it hosts the store where it can listen on the endpoint's address, as torchrun's c10d rendezvous does (the
    endpoint names this machine and its port is free; a launcher that finds the port taken is a client)."""
    if "is_host" in rdzv_conf:
        return _as_bool("is_host", str(rdzv_conf["is_host"]))
    if nnodes == 1:
        return True
    return None if node_rank is None else node_rank == 0


def check_endpoint(endpoint: str, *, nnodes: int, node_rank: int | None, rdzv_conf: dict[str, str]) -> None:
    """Bad endpoints end here, before anything is written or started (one line, exit 2).

    The node that hosts the store must resolve the endpoint's host to an address of its own and
    be able to listen on its port. On several nodes, a name that resolves to loopback on the host
    (``/etc/hosts`` often maps the machine's own name to 127.0.1.1) would leave the other nodes
    unable to connect: a literal loopback address or ``localhost`` is taken as meant (nodes on one
    machine). Other nodes are not checked: node 0's name may resolve, and its store open, only later. Without a
    node rank (torchrun's elastic form) the node that can listen there is the one that hosts.
    """
    host, port = parse_endpoint(endpoint, nnodes=nnodes)
    if nnodes > 1 and _is_unspecified(host):
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: {host} is no address the other nodes can reach; give "
                          "node 0's address, the same on every node, e.g. 10.0.0.5:29400")
    hosting = hosts_store(nnodes, node_rank, rdzv_conf)
    if hosting is False:
        return
    try:
        sock, address = bind_address(host, port)
    except ConfigError as exc:
        if hosting is None:  # not this machine's address, or another launcher here holds it: a client, as torchrun
            return
        where = "this machine hosts the rendezvous store" if nnodes == 1 else f"node {node_rank} hosts the rendezvous store"
        hint = "a free port" if "in use" in str(exc) else "an address of this machine"
        raise ConfigError(f"--rdzv-endpoint {endpoint!r}: {exc}; {where}, so give {hint}") from None
    sock.close()
    if nnodes > 1 and is_loopback(address) and not (is_loopback(host) or host == "localhost"):
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} resolves to {address} (loopback) on this machine, so the other "
            f"{nnodes - 1} node(s) could not reach the store; give this machine's network address, e.g. its IP")


def loopback_interface() -> str | None:
    """The name of the loopback interface (``lo`` on Linux), or None where none is found."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and is_loopback(a.address) for a in addrs):
            return name
    return None


def gloo_interface(nccl_ifname: str, interfaces: list[tuple[str, bool]]) -> str | None:
    """The interface gloo should use to match NCCL's ``NCCL_SOCKET_IFNAME`` on this host (pure).

    ``interfaces``: (name, up) of this host's interfaces. NCCL reads the variable as a comma-separated list of
    name prefixes, ``=name`` for an exact name, and a leading ``^`` to exclude instead; gloo takes exact names.
    The first up interface NCCL would accept is returned (loopback only when named); None when none matches.
    """
    spec = nccl_ifname.strip()
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    patterns = [p.strip() for p in spec.split(",") if p.strip()]

    def named(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in patterns)

    for name, up in interfaces:
        if not up:
            continue
        if exclude and not named(name) and not name.startswith(("lo", "docker")):  # NCCL skips these by default
            return name
        if not exclude and named(name):
            return name
    return None
