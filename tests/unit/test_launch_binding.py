"""Where the job's stores listen, which endpoints a node can host, and SIGTERM as a stop request.

torch's TCPStore servers listen on every interface (``*:PORT``) whatever host
they are given; the ``multigpu`` rendezvous backend binds them to the
endpoint's address (loopback on one node). These run torch's own rendezvous
handler in this process (no worker processes): tier 1.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
from datetime import timedelta

import psutil
import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from multigpu.errors import ConfigError
from multigpu.launch import rendezvous, stores
from multigpu.launch.rendezvous import check_endpoint


def _listening_ports() -> dict[int, set[str]]:
    out: dict[int, set[str]] = {}
    for conn in psutil.Process().net_connections(kind="inet"):
        if conn.status == psutil.CONN_LISTEN:
            out.setdefault(conn.laddr.port, set()).add(conn.laddr.ip)
    return out


def test_a_one_node_rendezvous_and_its_workers_store_listen_on_loopback_only(monkeypatch):
    """The stores a one-node job opens: the workers' store on 127.0.0.1 only, a fresh one per round, every worker
    a client; the rendezvous store listens nowhere (a FileStore in a folder only this user can open,
    removed at the end)."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # as the launcher sets it
    stores.register()
    params = RendezvousParameters(backend=stores.BACKEND, endpoint="localhost:0", run_id="binding", min_nodes=1,
                                  max_nodes=1, is_host=True, last_call_timeout=1)
    before = set(_listening_ports())
    handler = get_rendezvous_handler(params)
    private = handler._remove_private_dir.peek()[2][0]
    assert os.stat(private).st_mode & 0o777 == 0o700
    try:
        assert handler.use_agent_store  # the workers connect to the store below; none of them listens
        first = handler.next_rendezvous().bootstrap_store_info
        assert first.master_addr == "127.0.0.1"
        client = TCPStore(first.master_addr, first.master_port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        del client
        ports = _listening_ports()
        assert ports[first.master_port] == {"127.0.0.1"}
        assert all(ips == {"127.0.0.1"} for ips in ports.values()), ports
        assert set(ports) - before == {first.master_port}  # the rendezvous store does not listen
        second = handler.next_rendezvous().bootstrap_store_info  # a restart: a new store, the old one is gone
        assert second.master_port != first.master_port
        assert first.master_port not in _listening_ports()
    finally:
        handler.shutdown()
    assert not os.path.exists(private)


def test_a_multi_node_host_listens_on_the_endpoint_address_only(monkeypatch):
    """Node 0 of several: the rendezvous store listens on the endpoint's address, not on every interface."""
    monkeypatch.setenv(stores.SECRET_VAR, "0123456789abcdef")  # several nodes sign with a shared secret
    stores.register()
    params = RendezvousParameters(backend=stores.BACKEND, endpoint="127.0.0.1:0", run_id="binding2", min_nodes=2,
                                  max_nodes=2, is_host=True)
    before = set(_listening_ports())
    handler = get_rendezvous_handler(params)
    try:
        opened = {port: ips for port, ips in _listening_ports().items() if port not in before}
        assert list(opened.values()) == [{"127.0.0.1"}], opened
        assert stores._address_towards("127.0.0.1", 29400) == "127.0.0.1"  # where its workers' store would listen
    finally:
        handler.shutdown()


def test_endpoints_this_node_cannot_host_are_bad_input(monkeypatch):
    check_endpoint("localhost:0", nnodes=1, node_rank=0, rdzv_conf={})
    check_endpoint("127.0.0.1:29400", nnodes=2, node_rank=0, rdzv_conf={})  # nodes on one machine: meant
    check_endpoint("203.0.113.7:29400", nnodes=2, node_rank=1, rdzv_conf={})  # node 1 only connects, later
    with pytest.raises(ConfigError, match="203.0.113.7 .*not an address of this machine"):
        check_endpoint("203.0.113.7:29400", nnodes=2, node_rank=0, rdzv_conf={})
    with pytest.raises(ConfigError, match="does not resolve"):
        check_endpoint("no-such-host.invalid:29400", nnodes=2, node_rank=0, rdzv_conf={})
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_endpoint(f"127.0.0.1:{port}", nnodes=1, node_rank=0, rdzv_conf={})
    with pytest.raises(ConfigError, match="is_host=maybe is invalid"):
        check_endpoint("localhost:0", nnodes=1, node_rank=0, rdzv_conf={"is_host": "maybe"})
    check_endpoint("203.0.113.7:29400", nnodes=2, node_rank=0, rdzv_conf={"is_host": "false"})  # hosted elsewhere
    with pytest.raises(ConfigError, match="0.0.0.0 is no address the other nodes can reach"):
        check_endpoint("0.0.0.0:29400", nnodes=2, node_rank=1, rdzv_conf={})
    # /etc/hosts often maps the machine's own name to 127.0.1.1: the other nodes could not reach the store
    real = rendezvous.addresses
    monkeypatch.setattr(rendezvous, "addresses", lambda host, port, kind=socket.SOCK_STREAM:
                        real("127.0.1.1" if host == "node0" else host, port, kind))
    with pytest.raises(ConfigError, match="resolves to 127.0.1.1 \\(loopback\\)"):
        check_endpoint("node0:29400", nnodes=2, node_rank=0, rdzv_conf={})


def test_sigterm_is_a_stop_request_like_ctrl_c_with_checkpoint_on_interrupt(single_rank_group, tmp_path, monkeypatch):
    """SIGTERM (pre-emption, `timeout`) writes a checkpoint as SIGINT does (it used to write none). Both stop the
    loop at the next step on every rank, with the signal agreed (exit 128 + it), and SIGTERM still leaves the
    stack dump the launcher's failure summary reads; the wrapper's faulthandler dump is registered again after."""
    from multigpu.run.interrupt import InterruptFlag

    monkeypatch.setenv("MULTIGPU_STACKS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    with open(tmp_path / "wrapper.txt", "w") as dump:  # what the worker wrapper registers before the user's code
        faulthandler.register(signal.SIGTERM, file=dump, all_threads=True, chain=True)
        try:
            with InterruptFlag(True) as flag:
                assert not flag.agreed(single_rank_group.device)
                os.kill(os.getpid(), signal.SIGTERM)
                assert flag.received == signal.SIGTERM
                assert flag.agreed(single_rank_group.device) and flag.signum == signal.SIGTERM
            assert "test_sigterm_is_a_stop_request" in (tmp_path / "rank0.txt").read_text()
            assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        finally:
            assert faulthandler.unregister(signal.SIGTERM)  # registered again when the flag let go
    with InterruptFlag(False) as flag:
        assert not flag.agreed(single_rank_group.device) and flag.signum == 0
