"""Results independent of the split: the same agents and aggregates on 1, 2 and 3 gloo ranks.

For one config and seed, the final agent state (sorted by id) and every
per-step aggregate must be bit-identical across world sizes and across the
data, spatial and adaptive strategies (sync_frequency 1), and a checkpoint
written on 2 ranks must resume on 1 and 3 ranks to the same end state, each resume at another size checked
(the re-partitioned agents' state digest equals the saved one, bit for bit) and recorded as a resize.
Each spawn runs every case at once (a spawn costs seconds).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import multigpu as mg
from multigpu.checkpoint import CheckpointStore
from multigpu.run import Run, script_context
from multigpu.sim import checkpoint
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

STEPS = 10
SIR = SimConfig(model="sir", agents=6007, grid=(24, 20), steps=STEPS, chunk_size=1024, rebalance_every=3,
                params={"beta": 0.3, "radius": 1, "seir": True, "initial_infected": 0.02, "move_prob": 0.7})
CASES = {
    "sir-data": SIR,
    "sir-spatial": dataclasses.replace(SIR, strategy="spatial"),
    "sir-adaptive": dataclasses.replace(SIR, strategy="adaptive"),
    "sir0-spatial": dataclasses.replace(SIR, strategy="spatial", params={"radius": 0, "beta": 0.5}),
    "movement-adaptive": SimConfig(model="movement", agents=3001, grid=(7, 9), steps=STEPS, strategy="adaptive",
                                   rebalance_every=2, chunk_size=1024),
    "market-data": SimConfig(model="market", agents=4001, steps=STEPS, chunk_size=1024),
}
RESUME_AT = 4


def _resuming(path) -> Run:
    """The run harness resuming from checkpoint ``path`` (as a plain script's, without a run folder)."""
    return Run(script_context(None, str(path)), checkpoint_last=False)


def _gathered(engine: SimEngine):
    """Every agent, sorted by id, on rank 0 (None elsewhere)."""
    # gloo has no int16 collectives: widen for the gather, narrow back
    parts = {k: mg.gather(engine.state[k].to(torch.int64)) for k in engine.state.schema}
    if not mg.is_main():
        return None
    order = torch.argsort(parts["id"].to(torch.int64))
    return {k: v[order].to(engine.state.schema[k]) for k, v in parts.items()}


def _run_cases(ckpt_dir: str | None, resume_from: str | None, run_dir: str | None = None):
    out = {}
    for name, cfg in CASES.items():
        engine = SimEngine(cfg)
        if ckpt_dir is not None and name == "sir-spatial":
            engine.run(RESUME_AT)
            checkpoint.save(engine, CheckpointStore(ckpt_dir))
        series = engine.run()
        out[name] = (_gathered(engine), series, engine.rebalances)
    if resume_from is not None:
        for strategy in ("data", "adaptive"):
            engine = SimEngine(dataclasses.replace(SIR, strategy=strategy), populate=False)
            saved = checkpoint.load(engine, _resuming(resume_from))
            assert engine.step_index == RESUME_AT
            out[f"check-{strategy}"] = checkpoint.check_resize(engine, saved, resume_from, run_dir)
            series = engine.run()
            out[f"resumed-{strategy}"] = (_gathered(engine), series, [])
    return out if mg.is_main() else None


def _assert_same(got, want, label):
    state, series, _ = got
    ref_state, ref_series, _ = want
    assert series == ref_series, f"{label}: aggregates differ"
    assert state.keys() == ref_state.keys()
    for k in ref_state:
        assert torch.equal(state[k], ref_state[k]), f"{label}: field {k} differs"


def _reference_results():
    """World size 1 in this process (no process group): the results every split must reproduce."""
    out = {}
    for name, cfg in CASES.items():
        engine = SimEngine(cfg)
        series = engine.run()
        out[name] = (engine.state.sorted_by_id(), series, [])
    return out


def test_two_and_three_ranks_match_one_rank_and_resume_anywhere(tmp_path, capsys):
    from multigpu.runtime.context import read_resizes

    ref = _reference_results()
    # every strategy gives the same result at one rank already
    for name in ("sir-spatial", "sir-adaptive"):
        _assert_same(ref[name], ref["sir-data"], f"1 rank {name}")

    two = run_on_ranks(_run_cases, 2, args=(str(tmp_path), None), timeout_s=240)[0]
    for name in CASES:
        _assert_same(two[name], ref[name], f"2 ranks {name}")
    assert two["sir-adaptive"][2], "adaptive strategy never rebalanced"
    assert all(r["imbalance_after"] <= r["imbalance_before"] + 0.05 for r in two["movement-adaptive"][2])

    saved = tmp_path / f"step_{RESUME_AT:08d}"
    assert (saved / "manifest.json").is_file() and (saved / ".metadata").is_file()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    three = run_on_ranks(_run_cases, 3, args=(None, str(saved), str(run_dir)), timeout_s=240)[0]
    for name in CASES:
        _assert_same(three[name], ref[name], f"3 ranks {name}")
    for strategy in ("data", "adaptive"):
        _assert_same(three[f"resumed-{strategy}"], ref["sir-data"], f"resumed on 3 ranks ({strategy})")
    # each resume at 3 ranks of the 2-rank checkpoint: re-partitioned, checked bit for bit, recorded
    digest = json.loads((saved / "manifest.json").read_text())["meta"]["state_digest"]
    records = read_resizes(run_dir)
    assert [(r["from_ranks"], r["to_ranks"], r["step"]) for r in records] == [(2, 3, RESUME_AT)] * 2, records
    for strategy, entry in zip(("data", "adaptive"), records, strict=True):
        assert three[f"check-{strategy}"] == entry["check"]
        assert entry["check"]["equal"] and entry["check"]["bit_exact"], entry
        assert entry["check"]["saved_digest"] == entry["check"]["loaded_digest"] == digest
        assert entry["checkpoint"] == str(saved)

    # and the 2-rank checkpoint resumes in this single process too, checked the same way
    engine = SimEngine(SIR, populate=False)
    meta = checkpoint.load(engine, _resuming(saved))
    capsys.readouterr()
    assert checkpoint.check_resize(engine, meta, saved, None)["equal"]
    assert capsys.readouterr().out == (f"multigpu sim: resized from 2 to 1 rank(s) at step {RESUME_AT}: the state "
                                       f"loaded equals the saved one, bit for bit (digest {digest})\n")
    series = engine.run()
    _assert_same((engine.state.sorted_by_id(), series, []), ref["sir-data"], "resumed on 1 rank")

    # a re-partition that lost or changed one agent would not pass: the check compares every agent's state
    engine = SimEngine(SIR, populate=False)
    meta = checkpoint.load(engine, _resuming(saved))
    engine.state["state"][0] += 1
    check = checkpoint.check_resize(engine, meta, saved, None)
    assert not check["equal"] and not check["bit_exact"] and check["loaded_digest"] != digest
    assert "WARNING: the state loaded differs from the saved one" in capsys.readouterr().out
