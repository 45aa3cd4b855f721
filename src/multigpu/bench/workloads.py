"""The built-in workloads ``multigpu bench NAME`` can run (runs in the launcher).

Each feature adds its entry when it lands, e.g. the trainer::

    WORKLOADS["train"] = Workload("multigpu.train.bench", module=True,
                                  args=("--steps", "30"), help="nano-GPT training steps (tokens/s)")

The target is launched like any script (``multigpu bench --nproc 1,2 train``);
it must measure its steps with ``multigpu.monitor.StepMeter``, which writes the
``summary.json`` the bench reads, and honour ``multigpu.monitor.problem_scale()``
for weak scaling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from multigpu.errors import ConfigError

__all__ = ["PLANNED", "WORKLOADS", "Workload", "resolve_target"]


@dataclass(frozen=True)
class Workload:
    target: str
    """Module (``module=True``) or script path to launch."""
    module: bool = True
    args: tuple[str, ...] = ()
    """Arguments placed before the user's own."""
    help: str = ""
    """One line for the list of workloads."""


_CONFIGS = Path(__file__).resolve().parents[3] / "configs"

WORKLOADS: dict[str, Workload] = {
    "train": Workload("multigpu.train.worker", args=(str(_CONFIGS / "nano.yaml"), "steps=20", "eval_every=0",
                                                     "checkpoint_every=0", "log_every=0", "sample_chars=0"),
                      help="nano-GPT training steps, tokens/s; add key=value overrides"),
    "sim": Workload("multigpu.sim.worker", args=(str(_CONFIGS / "sir.yaml"), "agents=2000000", "steps=20", "plot=false"),
                    help="SIR epidemic steps, agent-steps/s; add key=value overrides (agents=..., strategy=...)"),
    "infer": Workload("multigpu.infer.worker",
                      help="sliding-window denoiser on the demo photo, windows/s; add key=value overrides (roi=[256], ...)"),
    "envs": Workload("multigpu.envs.bench", help="CartPole-v1 env-steps/s, 16,384 envs split over the ranks; "
                     "--num-envs N --steps S --env ID"),
}
"""name -> workload; filled in by the features (train, sim, infer, envs)."""

PLANNED = {"train": "training", "sim": "simulation", "infer": "inference", "envs": "batched environments"}
"""Names reserved for the built-in workloads still to come, and the feature that brings each."""


@dataclass(frozen=True)
class Target:
    target: str
    module: bool
    args: list[str] = field(default_factory=list)
    name: str | None = None
    """The workload's name when it was a built-in one."""


def _available() -> str:
    names = ", ".join(f"{k} ({w.help})" if w.help else k for k, w in sorted(WORKLOADS.items()))
    return names or "none registered yet"


def resolve_target(target: str, args: list[str], *, module: bool = False) -> Target:
    """A script path, a module (``-m``), or a built-in workload name -> what to launch.

    Raises:
        ConfigError: neither an existing script nor a known workload (lists what is available).
    """
    if module:
        return Target(target, True, list(args))
    if target in WORKLOADS:
        w = WORKLOADS[target]
        return Target(w.target, w.module, [*w.args, *args], name=target)
    if Path(target).is_file():
        return Target(target, False, list(args))
    if target.endswith(".py") or "/" in target:
        raise ConfigError(f"script '{target}' does not exist; give the path of a Python file, "
                          f"or a built-in workload: {_available()}")
    planned = f" ('{target}' arrives with the {PLANNED[target]} feature)" if target in PLANNED and target not in WORKLOADS else ""
    raise ConfigError(f"unknown workload '{target}'{planned}; built-in workloads: {_available()}; "
                      "or give a script path such as examples/allreduce_dp.py")
