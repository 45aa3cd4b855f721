"""The final state of a fixed SIR run, pinned: speed work on the kernels (C or torch) must not move a single agent.

One process, the spatial strategy, 300k agents for 30 steps with a fast epidemic (half the agents infected by the
end, so the kernels' infected-agent paths carry real load); tests/dist/test_sim_split.py holds 1, 2 and 3 ranks to
the same states, so this pins the multi-rank runs too. The digest is the one ``summary.json`` reports
(``state_digest``: a sum of one hash per agent record).
"""

from __future__ import annotations

import pytest
import torch

from multigpu.sim import native
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine

PINNED = ("00024a0b0206a56a", {"S": 33726, "I": 148240, "R": 118034})
"""Digest and final counts, computed before this round's kernel work (commit 235f547's code gives the same)."""


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_a_fixed_sir_run_ends_in_the_pinned_state(kernels):
    if kernels == "on" and not native.available():
        pytest.skip("no C compiler: the torch kernels run instead")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg = SimConfig(model="sir", agents=300_000, grid=(200, 300), steps=30, strategy="spatial", native=kernels,
                        params={"beta": 0.3, "gamma": 0.05, "initial_infected": 0.001, "move_prob": 0.5})
        engine = SimEngine(cfg)
        series = engine.run()
    finally:
        torch.set_num_threads(threads)
    assert engine.use_native is (kernels == "on")
    got = (f"{engine.state.digest_sum() & (2**64 - 1):016x}", {k: series[k][-1] for k in "SIR"})
    assert got == PINNED
