"""The launcher side: code that runs once per node, outside the ranks.

``launch(LaunchConfig(...), "train.py", args)`` starts one worker per selected
device through torchrun's elastic agent and summarises any failure.

The names below load on first use (PEP 562): a rank that only needs
``multigpu.launch.config`` (through the job registry) does not import torch's
elastic agent and launcher API with it (~0.15 s per rank).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multigpu.launch.agent import LaunchPlan, build_plan, launch
    from multigpu.launch.config import LaunchConfig
    from multigpu.launch.devices import DEVICE_VARIABLES, HostFacts, parse_gpus, plan_devices

_HOME = {"LaunchPlan": "agent", "build_plan": "agent", "launch": "agent", "LaunchConfig": "config",
         "DEVICE_VARIABLES": "devices", "HostFacts": "devices", "parse_gpus": "devices", "plan_devices": "devices"}

__all__ = ["DEVICE_VARIABLES", "HostFacts", "LaunchConfig", "LaunchPlan", "build_plan", "launch", "parse_gpus", "plan_devices"]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'multigpu.launch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"multigpu.launch.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
