"""What ``sim.calibrate`` may say (:class:`CalibrateConfig`) and whether a model can be calibrated so
(:func:`check_learning`): read in the launcher by :class:`~multigpu.sim.config.SimConfig`; the fitting itself is
:mod:`multigpu.sim.calibration`."""

from __future__ import annotations

from dataclasses import dataclass

from multigpu.errors import ConfigError

__all__ = ["LEARNABLE", "LOSSES", "CalibrateConfig", "check_learning"]

LEARNABLE = ("beta", "gamma")
"""What the built-in SIR's differentiable model learns."""
LOSSES = ("mse", "poisson")


@dataclass(frozen=True, kw_only=True, slots=True)
class CalibrateConfig:
    target: str = ""
    """CSV of the observed series (a ``step`` column and some of S, I, R; e.g. an exact run's series.csv).
    Set: ``multigpu sim`` calibrates instead of running once."""
    learn: tuple[str, ...] = ()
    """Float parameters of the model to learn, starting from ``params.*`` (default: the model's ``learnable``;
    sir: beta; sir learns some of beta, gamma)."""
    columns: tuple[str, ...] = ()
    """Series the loss compares (default: sir: those of I and R the target has; others: every series of the
    model the target has)."""
    loss: str = "mse"
    """mse (of the series as shares of the agents) or poisson (negative log-likelihood of the target's counts
    given the model's series as their means)."""
    weights: tuple[float, ...] = ()
    """A weight per entry of ``columns`` (default: 1 each)."""
    iterations: int = 40
    """Gradient steps at most."""
    lr: float = 0.1
    """Adam's learning rate on log(parameter): about the relative change per iteration."""
    decay: float = 0.95
    """The learning rate is multiplied by this after every iteration."""
    tolerance: float = 1e-3
    """Stop when every learned parameter moved less than this share in an iteration."""
    truncate: int = 0
    """Backpropagate through the last K steps only (0: all steps)."""
    replicates: int = 1
    """Fit the mean of this many replicates instead of one run: replicate k runs with the seed of replicate k of
    an ensemble (``--replicates``), so the fitted mean is the one ``multigpu sim --replicates K`` reports. The
    gradient is the mean of the replicates' gradients; memory and time grow K-fold. 1: the run's own seed."""

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ConfigError(f"sim.calibrate.loss {self.loss!r} is invalid; valid: {', '.join(LOSSES)}")
        if self.weights and (len(self.weights) != len(self.columns) or min(self.weights) < 0):
            raise ConfigError(f"sim.calibrate.weights={list(self.weights)} is invalid; valid: one weight >= 0 per "
                              f"entry of calibrate.columns ({list(self.columns)})")
        if self.iterations < 1 or self.truncate < 0 or not self.lr > 0 or not self.tolerance >= 0 \
                or not 0 < self.decay <= 1 or self.replicates < 1:
            raise ConfigError("sim.calibrate: valid: iterations >= 1, lr > 0, 0 < decay <= 1, tolerance >= 0, "
                              "truncate >= 0, replicates >= 1")


def check_learning(cfg, model) -> None:
    """ConfigError unless ``cfg.calibrate`` can serve ``model``: what it learns, the columns it compares."""
    from multigpu.sim.api import float_params, model_params

    ccfg = cfg.calibrate
    learn = ccfg.learn or model.learnable
    valid = LEARNABLE if model.name == "sir" else float_params(model.params)
    bad = [p for p in learn if p not in valid]
    if bad or not learn:
        raise ConfigError(f"sim.calibrate.learn={list(learn)} is invalid; valid: some of {', '.join(valid) or 'none'}"
                          + ("" if valid else f" (model {model.name!r} has no float parameters)"))
    params = model_params(model, cfg.params)
    names = [n for s in (model.substep(n) for n in cfg.substep_names) for n in s.series(params)]
    bad = [c for c in ccfg.columns if c not in names]
    if bad:
        raise ConfigError(f"sim.calibrate.columns: {bad} are not series of {model.name}; valid: {', '.join(names)}")
    if any(getattr(params, p) <= 0 for p in learn):
        raise ConfigError(f"sim.calibrate.learn: {[p for p in learn if getattr(params, p) <= 0]} start at 0 or "
                          "below; valid: a start > 0 (parameters are learned on a log scale)")
