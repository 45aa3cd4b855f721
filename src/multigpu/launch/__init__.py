"""The launcher side: code that runs once per node, outside the ranks.

``launch(LaunchConfig(...), "train.py", args)`` starts one worker per selected
device through torchrun's elastic agent and summarises any failure.
"""

from multigpu.launch.agent import LaunchPlan, build_plan, launch
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import DEVICE_VARIABLES, HostFacts, parse_gpus, plan_devices

__all__ = ["DEVICE_VARIABLES", "HostFacts", "LaunchConfig", "LaunchPlan", "build_plan", "launch", "parse_gpus", "plan_devices"]
