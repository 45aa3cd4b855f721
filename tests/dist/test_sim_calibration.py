"""Differentiable SIR: the same forward series and (within fp tolerance) the same gradients on 1 and 2 ranks;
gradient descent recovers a known beta; bad calibration input is one line.

The gradient contract: each rank backpropagates its own agents, the per-step field gradients and the
parameter gradients are all-reduced, so every rank holds the gradient a single process computes.
"""

from __future__ import annotations

import json

import pytest
import torch

from multigpu.cli import main
from multigpu.errors import ConfigError
from multigpu.sim.calibration import DiffSIR, loss_and_grads
from multigpu.sim.config import SimConfig
from multigpu.sim.engine import SimEngine
from multigpu.testing import run_on_ranks
from tests.conftest import ROOT, run_cli

CFG = SimConfig(model="sir", agents=3001, grid=(20, 20), steps=12, seed=1, chunk_size=1024,
                params={"beta": 0.04, "gamma": 0.1, "initial_infected": 0.02, "radius": 1})


def _target() -> dict[str, torch.Tensor]:
    series = SimEngine(SimConfig(**{**{f: getattr(CFG, f) for f in ("model", "agents", "grid", "steps")},
                                    "params": {**CFG.params, "beta": 0.06}})).run()
    return {c: torch.tensor(series[c], dtype=torch.float64) for c in ("I", "R")}


def _gradients(truncate: int = 0):
    model = DiffSIR(SimEngine(CFG))
    kept, series = model.forward(0.04, 0.1)
    loss, grad_series = loss_and_grads(series, _target(), CFG.agents)
    return series, loss, model.gradient(kept, grad_series, 0.04, 0.1, truncate)


def _on_two_ranks() -> dict:
    """This module's one 2-rank job: the SIR gradients, then the rumour model's under both losses."""
    return {"sir": _gradients(), "mse": _rumour_gradients("mse"), "poisson": _rumour_gradients("poisson")}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_on_ranks(_on_two_ranks, 2, timeout_s=300)


@pytest.mark.dist
def test_one_and_two_ranks_give_the_same_series_and_gradients(two_ranks):
    series, loss, grads = _gradients()
    assert grads["beta"] < 0  # the target has a faster epidemic: raise beta
    assert sum(series[c][-1] for c in "SIR") == CFG.agents
    # the relaxed forward pass takes the exact model's decisions (up to float-vs-integer rounding)
    exact = SimEngine(CFG).run()
    assert max(abs(a - b) for a, b in zip(series["I"], exact["I"], strict=True)) <= 3
    two = [r["sir"] for r in two_ranks]
    for got_series, got_loss, got_grads in two:  # every rank holds the same gradient
        assert got_series == series and got_loss == loss
        for p in ("beta", "gamma"):
            assert got_grads[p] == pytest.approx(grads[p], rel=1e-9, abs=1e-12), p
    truncated = _gradients(truncate=3)[2]  # the last 3 steps only: by then S is used up, so beta barely matters
    assert truncated["gamma"] < 0 and abs(truncated["beta"]) < abs(grads["beta"]) / 100


@pytest.mark.parametrize(
    "args, message",
    [
        (["--calibrate", "/no/such.csv"], "sim.calibrate.target '/no/such.csv' cannot be read"),
        (["--calibrate", "{csv}", "--steps", "50"], "has no row for step 11"),
        (["--calibrate", "{csv}", "calibrate.columns=[E]"], "are not series of sir"),
        (["--calibrate", "{csv}", "calibrate.learn=[sigma]"], "valid: some of beta, gamma"),
        (["--calibrate", "{csv}", "--strategy", "spatial"], "supports strategy data, models without a network field"),
        (["--model", "network_sir", "network.kind=households", "differentiable=true"], "substep 'network_sir'"),
        (["--calibrate", "{csv}", "calibrate.loss=l2"], "sim.calibrate.loss 'l2' is invalid; valid: mse, poisson"),
    ],
)
def test_bad_calibration_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    target = tmp_path / "target.csv"
    target.write_text("step,S,I,R\n" + "".join(f"{s},90,5,5\n" for s in range(1, 11)))
    args = [a.replace("{csv}", str(target)) for a in args]
    code = main(["sim", "-f", "sir", "--steps", "10", *args, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ConfigError, match="sir without seir"):
        SimConfig(model="sir", differentiable=True, params={"seir": True})


@pytest.mark.e2e
@pytest.mark.slow
def test_calibration_on_two_ranks_recovers_beta_within_five_percent(tmp_path):
    """The demo in small: a target made by the exact model with beta 0.05 (seed 0), calibration from 0.02 on
    2 ranks with another seed (so not the target's own random numbers)."""
    cfg = SimConfig(model="sir", agents=20_000, grid=(50, 50), steps=30,
                    params={"beta": 0.05, "gamma": 0.1, "initial_infected": 0.01})
    from multigpu.sim.runner import write_csv

    write_csv(SimEngine(cfg).run(), tmp_path / "target.csv")
    proc = run_cli("sim", "-f", "sir", "--agents", "20000", "--steps", "30", "--nproc-per-node", "2",
                   "--calibrate", str(tmp_path / "target.csv"), "--run-dir", str(tmp_path / "run"),
                   "grid=[50,50]", "seed=1", "params.beta=0.02", "params.gamma=0.1", "params.initial_infected=0.01",
                   "calibrate.iterations=40", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert abs(result["params"]["beta"] - 0.05) <= 0.05 * 0.05, result
    assert "calibrated in" in proc.stdout and (tmp_path / "run" / "calibration.csv").is_file()


RUMOUR = SimConfig(model="examples.sim_rumour:MODEL", agents=3001, grid=(20, 20), steps=10, seed=1, chunk_size=1024,
                   params={"p_tell": 0.08, "p_forget": 0.06})


def _rumour_gradients(loss: str):
    from multigpu.sim.calibration import CalibrateConfig, series_loss
    from multigpu.sim.differentiable import DiffRun

    target_cfg = SimConfig(model=RUMOUR.model, agents=RUMOUR.agents, grid=RUMOUR.grid, steps=RUMOUR.steps)
    want = SimEngine(target_cfg).run()  # the exact model at p_tell 0.05, p_forget 0.1, on this rank alone
    target = {c: torch.tensor(want[c], dtype=torch.float64) for c in ("informed", "forgot")}
    engine = SimEngine(RUMOUR)
    leaves = {p: torch.tensor(v, dtype=torch.float64, requires_grad=True) for p, v in RUMOUR.params.items()
              if p in ("p_tell", "p_forget")}
    got = DiffRun(engine).series(leaves)
    cfg = CalibrateConfig(loss=loss, columns=("informed", "forgot"), weights=(1.0, 2.0))
    value = series_loss(got, engine.series_names, target, engine.num_agents, cfg)
    value.backward()
    return got.detach(), float(value.detach()), DiffRun.all_reduce_grads(leaves).tolist()


@pytest.mark.dist
def test_a_user_model_gives_the_same_gradient_on_one_and_two_ranks(two_ranks):
    """The example's model (examples/sim_rumour.py): its forward series is the exact model's, and each rank's
    gradient of both learned parameters, after the all-reduce, is one process's (MSE and Poisson losses)."""
    exact = SimEngine(RUMOUR).run()
    for loss in ("mse", "poisson"):
        series, value, grads = _rumour_gradients(loss)
        assert series[:, 1].tolist() == exact["informed"] and series[:, 2].tolist() == exact["forgot"]
        assert grads[0] > 0 and grads[1] < 0, grads  # p_tell too high, p_forget too low: the gradient says so
        for got_series, got_value, got_grads in (r[loss] for r in two_ranks):
            assert torch.equal(got_series, series) and got_value == pytest.approx(value, rel=1e-12)
            assert got_grads == pytest.approx(grads, rel=1e-9, abs=1e-12), loss
