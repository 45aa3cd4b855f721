"""The rendezvous state is unpickled only when this job wrote it (tier 1, no workers).

torch's c10d handler unpickles the value of ``torch.rendezvous.<run_id>`` on every sync, and a TCPStore lets
anyone who connects write it. The ``multigpu`` backend signs every state blob with a secret that never goes
through the store; a value someone else wrote is refused, in one line naming tampering, before torch reads it.
Each test also runs torch's own backend on the same store as a control: the planted pickle does run there.
"""

from __future__ import annotations

import base64
import pickle
import re
import time
from datetime import timedelta

import pytest
from torch.distributed import HashStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from multigpu.launch import stores

SECRET = "0123456789abcdef0123"


class _Planted:
    """What an attacker stores: unpickling it creates ``path``."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant(store, run_id: str, marker) -> None:
    store.set(f"torch.rendezvous.{run_id}", base64.b64encode(pickle.dumps(_Planted(marker))))


def _params(run_id: str, **kw) -> RendezvousParameters:
    return RendezvousParameters(backend=stores.BACKEND, endpoint="127.0.0.1:0", run_id=run_id, min_nodes=2,
                                max_nodes=2, **kw)


def test_a_planted_state_is_refused_by_a_multi_node_host_and_run_by_torchs_own_backend(tmp_path, monkeypatch):
    monkeypatch.setenv(stores.SECRET_VAR, SECRET)
    stores.register()
    handler = get_rendezvous_handler(_params("signing", is_host=True))
    try:
        port = handler._inner._state_holder._backend._inner._store.port
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))  # anyone on the host
        assert handler.num_nodes_waiting() == 0  # syncs: its own, signed state reads back
        _plant(client, "signing", tmp_path / "ours")
        with pytest.raises(RendezvousStateError, match=re.escape(stores.TAMPERED)):
            for _ in range(40):  # the handler reads the store again once its cached state is 1 s old
                handler.num_nodes_waiting()
                time.sleep(0.1)
        assert not (tmp_path / "ours").exists()
        # the control: torch's own backend on a store with the same planted value runs it
        store = HashStore()
        plain = create_handler(store, C10dRendezvousBackend(store, "signing"), _params("signing"))
        _plant(store, "signing", tmp_path / "torchs")
        with pytest.raises(Exception):  # noqa: B017 - the unpickled file object is no state
            plain.num_nodes_waiting()
        assert (tmp_path / "torchs").exists()
    finally:
        handler.shutdown()


def test_nodes_with_different_secrets_are_told_so_and_state_is_signed_in_the_store(monkeypatch):
    store = HashStore()
    ours = stores.SignedBackend(C10dRendezvousBackend(store, "r"), SECRET.encode())
    assert ours.set_state(b"state")[0] == b"state"
    assert ours.get_state()[0] == b"state"
    raw = base64.b64decode(store.get("torch.rendezvous.r"))
    assert raw.endswith(b"state") and len(raw) == 32 + len(b"state")  # HMAC-SHA256 in front
    other = stores.SignedBackend(C10dRendezvousBackend(store, "r"), b"another secret, another node")
    with pytest.raises(RendezvousStateError, match="does not match.*different MULTIGPU_RDZV_SECRET"):
        other.get_state()
    with pytest.raises(RendezvousStateError, match=re.escape(stores.TAMPERED)):  # a write that loses returns their value
        other.set_state(b"mine", None)
    store.set("torch.rendezvous.r", base64.b64encode(b"short"))
    with pytest.raises(RendezvousStateError, match=re.escape(stores.TAMPERED)):
        ours.get_state()


def test_after_a_worker_fails_the_launcher_can_tell_a_planted_state_from_a_signed_one(tmp_path, monkeypatch):
    """Several nodes: a node whose workers failed because another node stopped on a planted state asks
    ``stores.tampered`` and names the cause (the race the store-attack e2e test lost under load)."""
    monkeypatch.setenv(stores.SECRET_VAR, SECRET)
    stores.register()
    handler = get_rendezvous_handler(_params("after-failure", is_host=True))
    try:
        assert handler.num_nodes_waiting() == 0  # its own state, signed, is in the store
        assert stores.tampered("after-failure") is None
        assert stores.tampered("another-run") is None  # no backend of this launcher: nothing to say
        port = handler._inner._state_holder._backend._inner._store.port
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        _plant(client, "after-failure", tmp_path / "pwned")
        refused = stores.tampered("after-failure")
        assert isinstance(refused, RendezvousStateError) and stores.TAMPERED in str(refused)
        assert not (tmp_path / "pwned").exists()
    finally:
        handler.shutdown()


@pytest.mark.parametrize("planted", [b"{not base64!}", base64.b64encode(b"short")])
def test_a_value_written_over_the_state_is_tampering_naming_the_store_and_the_key(tmp_path, monkeypatch, planted):
    """Whatever someone writes over the state (a value that is not even base64, which torch's backend decodes
    first and called "The state object is corrupt", or one not signed) is refused as tampering, in a line that
    names the store's address and the key; ``stores.tampered`` says the same after a worker failed."""
    monkeypatch.setenv(stores.SECRET_VAR, SECRET)
    stores.register()
    handler = get_rendezvous_handler(_params("named", is_host=True))
    try:
        port = handler._inner._state_holder._backend._inner._store.port
        assert handler.num_nodes_waiting() == 0
        TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)).set("torch.rendezvous.named",
                                                                                       planted)
        refused = stores.tampered("named")
        assert isinstance(refused, RendezvousStateError), refused
        assert str(refused).startswith(f"the rendezvous state (key torch.rendezvous.named in the rendezvous store at "
                                       f"127.0.0.1:{port}) {stores.TAMPERED}: "), refused
        with pytest.raises(RendezvousStateError, match=re.escape(str(refused))):
            for _ in range(40):  # the handler reads the store again once its cached state is 1 s old
                handler.num_nodes_waiting()
                time.sleep(0.1)
    finally:
        handler.shutdown()
