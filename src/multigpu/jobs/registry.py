"""The built-in workloads, and how a name or ``pkg.module:NAME`` becomes a :class:`Workload` (both sides).

Built-ins are imported only when asked for, so ``multigpu --help`` stays fast.
"""

from __future__ import annotations

import importlib

from multigpu.errors import ConfigError
from multigpu.jobs.workload import Workload

__all__ = ["BUILTIN", "get_workload", "is_workload_spec"]

BUILTIN: dict[str, str] = {
    "train": "multigpu.train.job:WORKLOAD",
    "sim": "multigpu.sim.job:WORKLOAD",
    "infer": "multigpu.infer.job:WORKLOAD",
    "rl": "multigpu.rl.job:WORKLOAD",
    "envs": "multigpu.envs.job:WORKLOAD",
}
"""name -> where its :class:`Workload` object lives."""


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
    return importlib.import_module(BUILTIN[name].partition(":")[0]).WORKLOAD
