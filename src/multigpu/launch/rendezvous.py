"""Rendezvous endpoint parsing and multi-node checks (pure; runs in the launcher)."""

from __future__ import annotations

from multigpu.errors import ConfigError

__all__ = ["parse_endpoint"]


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
