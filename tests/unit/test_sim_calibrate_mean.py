"""Calibration to the mean of K replicates (``calibrate.replicates=K``).

The target is an ensemble's mean (what ``multigpu sim --replicates K`` reports); the fit runs the K
replicates with the same seeds (an ensemble's replicates 0..K-1) and descends on the loss of their mean.
Pinned: the series it fits is the mean of the K runs, and the fit recovers the parameter that made the
target.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from multigpu.sim.calibration import DiffSIR, calibrate
from multigpu.sim.config import SimConfig
from multigpu.sim.design import replicate_seed
from multigpu.sim.engine import SimEngine
from multigpu.sim.ensemble import run_ensemble

K = 4
BASE = dict(model="sir", agents=1500, grid=(15, 15), steps=14, plot=False,
            params={"gamma": 0.1, "initial_infected": 0.03, "radius": 1})


def _ensemble_mean(beta: float) -> dict[str, torch.Tensor]:
    result = run_ensemble(SimConfig(**{**BASE, "params": {**BASE["params"], "beta": beta}},
                                    ensemble={"replicates": K}), log=lambda line: None)
    names = result.names[0]
    return {c: torch.tensor(result.bands[0].mean[:, names.index(c)]) for c in ("I", "R")}


def test_the_fit_is_on_the_mean_of_k_replicates_and_recovers_beta():
    target = _ensemble_mean(0.06)
    cfg = SimConfig(**{**BASE, "params": {**BASE["params"], "beta": 0.03}},
                    calibrate={"target": "", "replicates": K, "iterations": 30, "lr": 0.15})
    result = calibrate(cfg, target, log=lambda line: None)
    assert result.fitted and result.params["beta"] == pytest.approx(0.06, rel=0.1), result.params
    # its first iteration's series: the mean of the K relaxed runs with the ensemble's seeds, at the start
    runs = [DiffSIR(SimEngine(dataclasses.replace(cfg, seed=replicate_seed(cfg.seed, 0, k)))).forward(0.03, 0.1)[1]
            for k in range(K)]
    first = calibrate(dataclasses.replace(cfg, calibrate=dataclasses.replace(cfg.calibrate, iterations=1)), target,
                      log=lambda line: None)
    for c in "SIR":
        assert first.series[c] == pytest.approx([sum(v) / K for v in zip(*(r[c] for r in runs), strict=True)], abs=1e-9), c


def test_a_user_model_fits_the_mean_of_its_replicates():
    cfg = SimConfig(model="examples.sim_rumour:MODEL", agents=800, grid=(10, 10), steps=10, seed=2,
                    calibrate={"target": "", "replicates": 3, "iterations": 1})
    one = [SimEngine(dataclasses.replace(cfg, calibrate=dataclasses.replace(cfg.calibrate, replicates=1),
                                         seed=replicate_seed(2, 0, k))).run() for k in range(3)]
    names = [n for n in one[0] if n != "step"]
    target = {n: torch.tensor([float(v) * 1.5 for v in one[0][n]], dtype=torch.float64) for n in names}
    result = calibrate(cfg, target, log=lambda line: None)
    for n in names:  # the relaxed forward pass takes the exact decisions: the mean of the exact runs
        assert result.series[n] == pytest.approx([sum(v) / 3 for v in zip(*(r[n] for r in one), strict=True)], abs=0.5), n
