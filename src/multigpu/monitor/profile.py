"""``--profile``: a torch.profiler trace per rank for a window of steps (inside the ranks).

``--profile`` (any launching command) sets ``profile`` in the run context; every
``StepMeter.from_context`` then profiles a window of its steps and each rank
writes ``<run_dir>/profile/rank<r>.json`` (a Chrome trace: open it in
https://ui.perfetto.dev or chrome://tracing). The window is
``--profile-steps wait,warmup,active`` (default ``1,1,3``): skip ``wait`` steps,
warm the profiler up for ``warmup`` steps, record ``active`` steps.
A run shorter than the window writes what it recorded when the meter closes.
"""

from __future__ import annotations

import sys
from pathlib import Path

from multigpu.files import atomic_path

__all__ = ["StepProfiler", "profiler_for"]


class StepProfiler:
    """torch.profiler over a window of steps; call :meth:`step` after every step and :meth:`stop` at the end.

    Args:
        path: Where the Chrome trace goes (one file per rank).
        window: (wait, warmup, active) steps.
    """

    def __init__(self, path: str | Path, window: tuple[int, int, int] = (1, 1, 3)):
        import torch
        from torch.profiler import ProfilerActivity, profile, schedule

        self.path = Path(path)
        self.written = False
        wait, warmup, active = window
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=wait, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._save,
        )
        self._prof.start()

    def _save(self, prof) -> None:
        with atomic_path(self.path) as tmp:
            prof.export_chrome_trace(str(tmp))
        self.written = True

    def step(self) -> None:
        self._prof.step()

    def stop(self) -> None:
        if self._prof is not None:
            self._prof.stop()
            self._prof = None


def profiler_for(run, run_dir: Path | None) -> StepProfiler | None:
    """A :class:`StepProfiler` for this rank when the run context ``run`` asks for ``--profile``, else None."""
    if not run.profile:
        return None
    from multigpu.runtime import group

    if run_dir is None:
        if group.rank() == 0:
            print("multigpu: --profile needs a run directory; no trace written", file=sys.stderr)
        return None
    return StepProfiler(Path(run_dir) / "profile" / f"rank{group.rank()}.json", run.profile_steps)
