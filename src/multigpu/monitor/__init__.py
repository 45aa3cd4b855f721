"""Monitoring inside the ranks: step meters (and, beside them, device samplers and sinks)."""

from multigpu.monitor.meters import StepMeter, problem_scale, run_dir_from_env, write_json_atomic

__all__ = ["StepMeter", "problem_scale", "run_dir_from_env", "write_json_atomic"]
