"""A one-node rendezvous does not wait: torch's handler slept a random 0-0.3 s before its first round ("to skew
the attempts across the nodes"), on one node too, where there is nothing to skew; and it named the caller of every
event record with ``inspect.stack()``, which reads the source of every frame, twice per record. Several nodes keep
the skew. (No speed is asserted: what is pinned is that the sleep is not asked for, and that the name is torch's.)"""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from multigpu.launch import stores


@pytest.fixture
def delays(monkeypatch):
    asked: list = []
    monkeypatch.setattr(dynamic_rendezvous, "_delay", lambda seconds: asked.append(seconds))  # never sleeps
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", dynamic_rendezvous.get_method_name)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    monkeypatch.setenv(stores.SECRET_VAR, "0123456789abcdef0123")
    stores.register()
    return asked


def _join(nodes: int) -> None:
    params = RendezvousParameters(backend=stores.BACKEND, endpoint="127.0.0.1:0", run_id=f"skew{nodes}",
                                  min_nodes=1, max_nodes=nodes, is_host=True, last_call_timeout=1)
    handler = get_rendezvous_handler(params)
    try:
        handler.next_rendezvous()
    finally:
        handler.shutdown()


def test_one_node_joins_without_the_random_skew_and_several_keep_it(delays):
    _join(1)
    assert not [d for d in delays if isinstance(d, tuple)]
    _join(2)  # min 1 of 2: this node alone completes the round after its last call
    assert (0, 0.3) in delays


def _records_name(get) -> str:
    def _record():  # torch's shape: the handler's _record asks for the name of the method that called it
        return get()

    def next_rendezvous():
        return _record()

    return next_rendezvous()


def test_the_caller_named_in_torchs_event_records_is_the_one_torch_named(delays):
    torchs = stores._TORCH_METHOD_NAME
    assert torchs is not stores._method_name and dynamic_rendezvous.get_method_name is stores._method_name
    assert _records_name(torchs) == _records_name(stores._method_name) == "next_rendezvous"
    assert stores._method_name(10_000) == torchs(10_000) == "no_method_name"
