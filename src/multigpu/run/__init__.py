"""The run harness of every workload (inside each rank): :class:`Run` owns the run directory, the checkpoints
(store, cadence, background writer), resume, the step meter, callbacks, signal-time checkpoints and
``summary.json``; a workload supplies its step and its state. See :mod:`multigpu.run.harness`.
"""

from multigpu.run.harness import Run, StepEvent, script_context

__all__ = ["Run", "StepEvent", "script_context"]
