"""The built-in workloads, and how a name or ``pkg.module:NAME`` becomes a :class:`Workload` (both sides).

Built-ins are imported only when asked for, so ``multigpu --help`` stays fast.
"""

from __future__ import annotations

import importlib

from multigpu.errors import ConfigError
from multigpu.jobs.workload import Workload

__all__ = ["BUILTIN", "builtin", "commands", "get_workload", "is_command", "is_workload_spec"]

BUILTIN: dict[str, str] = {
    "train": "multigpu.train.job:WORKLOAD",
    "sim": "multigpu.sim.job:WORKLOAD",
    "infer": "multigpu.infer.job:WORKLOAD",
    "rl": "multigpu.rl.job:WORKLOAD",
    "envs": "multigpu.envs.job:WORKLOAD",
}
"""name -> where its :class:`Workload` entry lives: the one line that makes a workload built in. Everything
else about it (whether it is a command, its help, its preset, its ``bench`` overrides) is in that entry."""


def is_workload_spec(text: str) -> bool:
    """True for a built-in name or something shaped like ``pkg.module:NAME``."""
    module, sep, attr = text.partition(":")
    return text in BUILTIN or (bool(sep) and attr.isidentifier() and all(p.isidentifier() for p in module.split(".")))


def get_workload(spec: str) -> Workload:
    """A built-in name (``train``) or ``pkg.module:NAME`` -> the Workload; one-line ConfigError otherwise."""
    from multigpu.factory import import_object

    target = BUILTIN.get(spec, spec)
    if ":" not in target:
        raise ConfigError(f"unknown workload {spec!r}; valid: {', '.join(sorted(BUILTIN))}, or pkg.module:WORKLOAD")
    workload = import_object(target, what="workload")
    if not isinstance(workload, Workload):
        raise ConfigError(f"{spec!r} is a {type(workload).__name__}, not a multigpu.jobs.Workload")
    return workload


def builtin(name: str) -> Workload:
    """A built-in workload by name (imports its module)."""
    module, _, attr = BUILTIN[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def commands() -> list[str]:
    """The built-ins that are commands (``multigpu <name>``), in :data:`BUILTIN`'s order; imports each."""
    return [name for name in BUILTIN if builtin(name).command]


def is_command(name: str) -> bool:
    """True for a built-in workload whose entry makes it a command; imports that one only."""
    return name in BUILTIN and builtin(name).command
