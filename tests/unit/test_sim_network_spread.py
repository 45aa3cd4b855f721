"""Summing messages along the edges out of the few agents that send one (the CPU's network step).

:func:`multigpu.sim.network.spread` visits only the edges of the active sources (an epidemic's infected), grouped
by source once at setup; these pin it to the plain sum over every edge, in bounded chunks, for integer
messages of any value.
"""

from __future__ import annotations

import torch

from multigpu.sim import network


def _dense(src, dst, values, n):
    out = torch.zeros(n, dtype=torch.int64)
    return out.index_add_(0, dst, values[src])


def test_spread_equals_the_sum_over_every_edge(monkeypatch):
    g = torch.Generator().manual_seed(5)
    n, e = 500, 4000
    src, dst = torch.randint(0, n, (e,), generator=g), torch.randint(0, n, (e,), generator=g)
    src[:300] = 7  # one source with many edges: a chunk boundary falls inside it
    ptr, targets = network.by_source(src, dst, n)
    values = torch.randint(-3, 4, (n,), generator=g) * (torch.rand(n, generator=g) < 0.2)
    for chunk in (1 << 20, 64):  # one chunk, then many
        monkeypatch.setattr(network, "_EDGE_CHUNK", chunk)
        got = network.spread(ptr, targets, values, torch.zeros(n, dtype=torch.int64))
        assert torch.equal(got, _dense(src, dst, values, n)), chunk
    assert int(got.abs().sum()) > 0
    on = values != 0  # bools (the infected): each edge adds one
    assert torch.equal(network.spread(ptr, targets, on, torch.zeros(n, dtype=torch.int64)),
                       _dense(src, dst, on.to(torch.int64), n))
    none = network.spread(ptr, targets, torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
    assert not none.any()
