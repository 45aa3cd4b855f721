"""Monitoring inside the ranks: step meters, the device sampler and the step profiler."""

from multigpu.monitor.meters import StepMeter, write_json_atomic
from multigpu.monitor.profile import StepProfiler
from multigpu.monitor.sampler import Sampler

__all__ = ["Sampler", "StepMeter", "StepProfiler", "write_json_atomic"]
