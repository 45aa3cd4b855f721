"""What ``multigpu bench`` and ``multigpu verify`` run: a script, a module, or a workload (runs in the launcher).

    multigpu bench --nproc 1,2 examples/allreduce_dp.py      # a script (measured by its StepMeter, or wall clock)
    multigpu bench --nproc 1,2 train steps=40                # a built-in workload plus key=value overrides
    multigpu bench --nproc 1,2 mypkg.count:WORKLOAD n=1000   # any workload object

A workload goes through the job contract (:mod:`multigpu.jobs`): its config is
its preset (if any), then its ``bench`` overrides (shorter runs, no plots), then
the user's; every world size is checked before the first run starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from multigpu.errors import ConfigError

__all__ = ["Target", "available", "resolve_target"]


@dataclass(frozen=True)
class Target:
    target: str
    """A script path, a module (``module=True``), or a workload spec (``workload=True``)."""
    module: bool
    args: list[str] = field(default_factory=list)
    """The script's arguments, or the workload's key=value overrides."""
    name: str | None = None
    """The workload's name when it was a built-in one."""
    workload: bool = False
    """Runs through the job contract (a built-in name or ``pkg.module:WORKLOAD``)."""
    config: str | None = None
    """A workload's ``-f FILE|PRESET`` (None: its preset)."""
    flags: dict = field(default_factory=dict)
    """A workload's shortcut flags as given (``{config key: value}``), as ``multigpu <workload>`` takes them."""


def available() -> str:
    """The built-in workloads ``bench`` knows, with one line each."""
    from multigpu.jobs.registry import BUILTIN, builtin

    return ", ".join(f"{name} ({builtin(name).help})" for name in sorted(BUILTIN))


def resolve_target(target: str, args: list[str], *, module: bool = False, config: str | None = None,
                   flags: dict | None = None) -> Target:
    """A script path, a module (``-m``), a built-in workload name or ``pkg.module:WORKLOAD`` -> what to launch.

    Raises:
        ConfigError: neither an existing script nor a known workload (lists what is available).
    """
    from multigpu.jobs.registry import BUILTIN, is_workload_spec

    if module or Path(target).is_file():
        if config is not None:
            raise ConfigError(f"-f {config} is a workload's config, and {target} is a script: give its own "
                              "arguments after its path")
        return Target(target, module, list(args))
    if is_workload_spec(target):
        return Target(target, False, list(args), name=target if target in BUILTIN else None, workload=True,
                      config=config, flags={k: v for k, v in (flags or {}).items() if v is not None})
    if target.endswith(".py") or "/" in target:
        raise ConfigError(f"script '{target}' does not exist; give the path of a Python file, "
                          f"or a built-in workload: {available()}")
    raise ConfigError(f"unknown workload '{target}'; built-in workloads: {available()}; "
                      "or pkg.module:WORKLOAD, or a script path such as examples/allreduce_dp.py")
