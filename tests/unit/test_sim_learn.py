"""Calibrating any model's float parameters: the straight-through decisions, what can be learned, and a target
without signal reported as no fit (not as a fit)."""

from __future__ import annotations

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.sim import Context, Model, Substep
from multigpu.sim.calibration import calibrate, flat_target
from multigpu.sim.config import SimConfig

RUMOUR = "examples.sim_rumour:MODEL"


def _ctx() -> Context:
    return Context(seed=3, step=2, params=None, grid=(4, 4))


def test_bernoulli_with_a_tensor_probability_is_hard_forward_and_straight_through_backward():
    ctx, ids = _ctx(), torch.arange(20_000, dtype=torch.int32)
    p = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    d = ctx.bernoulli(ids, p, "x")
    assert d.dtype == torch.float64 and set(d.detach().unique().tolist()) == {0.0, 1.0}
    assert abs(float(d.detach().mean()) - 0.3) < 0.02
    assert torch.equal(d.detach().bool(), ctx.bernoulli(ids, 0.3, "x"))  # the exact model's decisions
    d.sum().backward()
    assert float(p.grad) == 20_000  # d decision / d p = 1 per agent
    probs = torch.tensor([[0.2, 0.5, 0.3]], dtype=torch.float64).expand(20_000, 3).clone().requires_grad_()
    one = ctx.categorical(ids, probs, "c")
    assert torch.equal(one.detach().sum(1), torch.ones(20_000, dtype=torch.float64))
    assert one.detach().mean(0).sub(torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)).abs().max() < 0.02
    one[:, 1].sum().backward()
    assert probs.grad[:, 1].eq(1).all() and probs.grad[:, 0].eq(0).all()


def test_what_can_be_learned_is_checked_in_one_line():
    base = dict(model=RUMOUR, agents=100, grid=(10, 10), steps=3, calibrate={"target": "t.csv"})
    for extra, message in [
        ({"calibrate": {"target": "t.csv", "learn": ["move"]}}, "valid: some of p_tell, p_forget, seeded, move_prob"),
        ({"calibrate": {"target": "t.csv", "columns": ["S"]}}, "['S'] are not series of rumour-learnable; "
                                                               "valid: moved, informed, forgot"),
        ({"calibrate": {"target": "t.csv", "loss": "l1"}}, "valid: mse, poisson"),
        ({"calibrate": {"target": "t.csv", "columns": ["informed"], "weights": [1, 2]}}, "one weight >= 0 per entry"),
        ({"params": {"p_forget": 0.0}}, "start at 0 or below"),
        ({"strategy": "spatial"}, "supports strategy data"),
    ]:
        with pytest.raises(ConfigError) as err:
            SimConfig(**{**base, **extra})
        assert message in str(err.value) and "\n" not in str(err.value), (extra, str(err.value))
    assert SimConfig(**base).calibrate.learn == ()  # the model's learnable: p_tell, p_forget
    with pytest.raises(ConfigError, match=r"learnable=\['nope'\] is invalid; valid: float fields of NoParams: none"):
        Model(name="m", fields={"id": torch.int32}, init=lambda c, i: {"id": i}, learnable=["nope"],
              substeps=[Substep("s", apply=lambda c, a, p: None)])


def test_a_flat_target_is_no_fit_and_says_why(tmp_path):
    cfg = SimConfig(model=RUMOUR, agents=2000, grid=(16, 16), steps=5, params={"seeded": 0.001},
                    calibrate={"target": "unused.csv"})
    flat = {"informed": torch.full((5,), 2.0, dtype=torch.float64), "forgot": torch.zeros(5, dtype=torch.float64)}
    result = calibrate(cfg, flat, run_dir=tmp_path)
    assert not result.fitted and result.history == [] and result.params == {"p_tell": 0.05, "p_forget": 0.1}
    assert result.reason.startswith("the target series vary by less than 1% of the 2,000 agents (informed by 0, "
                                    "forgot by 0): too little signal")
    assert '"fitted": false' in (tmp_path / "calibration.json").read_text()
    assert flat_target({"I": torch.tensor([0.0, 30.0])}, 2000) == ""


def test_a_parameter_the_series_do_not_depend_on_is_no_fit():
    """move_prob enters the built-in movement kernel as an integer threshold: no gradient reaches it."""
    from multigpu.sim.engine import SimEngine

    base = dict(model=RUMOUR, agents=2000, grid=(16, 16), steps=6, params={"seeded": 0.05})
    want = SimEngine(SimConfig(**base)).run()
    target = {c: torch.tensor(want[c], dtype=torch.float64) for c in ("informed", "forgot")}
    cfg = SimConfig(**{**base, "seed": 1, "params": {"seeded": 0.05, "move_prob": 0.3}},
                    calibrate={"target": "unused.csv", "learn": ["move_prob"]})
    result = calibrate(cfg, target)
    assert not result.fitted and result.params == {"move_prob": 0.3} and len(result.history) == 1
    assert result.reason == ("the loss does not change with move_prob (gradient +0.0e+00 at the start): the target "
                             "series carry no signal about them"), result.reason
