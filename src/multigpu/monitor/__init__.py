"""Monitoring inside the ranks: step meters, the device sampler and the step profiler."""

from multigpu.monitor.meters import StepMeter, problem_scale, run_dir_from_env, write_json_atomic
from multigpu.monitor.profile import StepProfiler
from multigpu.monitor.sampler import Sampler

__all__ = ["Sampler", "StepMeter", "StepProfiler", "problem_scale", "run_dir_from_env", "write_json_atomic"]
