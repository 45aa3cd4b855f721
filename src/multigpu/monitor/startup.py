"""Where a run's start-up went, from the command to the first step (inside each rank; the arithmetic is pure).

Marks, each a wall-clock time (``time.time()``) taken once per attempt:

==================  ==========================================================  =====================================
mark                when                                                        taken by
==================  ==========================================================  =====================================
``launcher_start``  the launcher's process began (later launches of the same    the launcher, into ``run.json``'s
                    process, ``bench``'s and ``verify``'s: its call to launch)  ``startup``
``launcher_ready``  it hands the job to torch's agent (imports, argument and    the launcher, same
                    config checks, device plan and run file done)
``worker_start``    this rank's process began                                   the worker wrapper, into
                                                                                ``<stacks dir>/startup/rank<R>.json``
``worker_ready``    the wrapper has imported torch and runs the script          the worker wrapper
``group_joined``    the rank joined its process group                           the worker wrapper
``first_step``      the first step began                                        :class:`~multigpu.monitor.StepMeter`
``first_step_end``  the first step ended                                        :class:`~multigpu.monitor.StepMeter`
==================  ==========================================================  =====================================

The job reaches a mark when its last rank does (the latest time over ranks), and its start-up is cut into
:data:`PARTS` between consecutive marks; a part whose mark is missing (a script run without the launcher, a
meter without a process group) is left out and the next part starts from the last mark there is. The worker
also notes how long its ``import torch`` took (``torch_import_s``): the floor of any worker's start.

Clocks: every mark of one node comes from the same clock; on several nodes, marks of different nodes are as far
apart as their clocks are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["MARKS", "PARTS", "STARTUP_DIR", "TORCH_IMPORT", "job_startup", "rank_marks"]

STARTUP_DIR = "startup"
"""Under the stacks dir (``MULTIGPU_STACKS_DIR``): the worker wrapper's ``rank<R>.json`` (it keeps a copy of this
name: it runs before multigpu may be imported)."""

MARKS = ("launcher_start", "launcher_ready", "worker_start", "worker_ready", "group_joined", "first_step",
         "first_step_end")

PARTS = (
    ("launcher", "launcher_ready", "the launcher's own start: interpreter, imports, argument and config checks, "
                                   "device plan, run file"),
    ("rendezvous", "worker_start", "torch's agent: the rendezvous of the nodes, then starting the workers (a "
                                   "forked worker also waits for the modules its fork server imports for it)"),
    ("worker start", "worker_ready", "a worker's interpreter and its torch import"),
    ("to process group", "group_joined", "the script's or workload's imports and config, then joining the "
                                         "process group (waiting there for every rank)"),
    ("set-up", "first_step", "the workload's set-up after the group: data, model, state"),
)
"""(name, the mark it ends at, what it holds): consecutive, from ``launcher_start``."""

TORCH_IMPORT = ("a worker's own `import torch` (part of worker start): the floor of any worker that starts a fresh "
                "interpreter")
"""What ``torch_import_s`` is, in words (bench's and the report's tables)."""


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def rank_marks(first_step: tuple[float, float] | None = None, env=None) -> dict[str, Any]:
    """This rank's marks: the launcher's (``run.json``), the worker wrapper's and ``first_step`` (start, end).

    Marks of the launcher are left out in a worker group that torch's agent restarted: they belong to the
    first attempt."""
    from multigpu import envvars

    env = os.environ if env is None else env
    marks: dict[str, Any] = {}
    if env.get(envvars.RUN_FILE) and env.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        launcher = _read(Path(env[envvars.RUN_FILE])).get("startup")
        if isinstance(launcher, dict):
            marks.update({k: launcher.get(k) for k in ("launcher_start", "launcher_ready")})
    if env.get(envvars.STACKS_DIR):
        marks.update(_read(Path(env[envvars.STACKS_DIR]) / STARTUP_DIR / f"rank{env.get('RANK', '0')}.json"))
    if first_step is not None:
        marks["first_step"], marks["first_step_end"] = first_step
    return {k: v for k, v in marks.items() if k in (*MARKS, "torch_import_s") and isinstance(v, (int, float))}


def _latest(ranks: Sequence[dict[str, Any]], mark: str) -> float | None:
    """When the job reached ``mark``: its last rank's time; None when some rank has no such mark."""
    values = [r.get(mark) for r in ranks]
    return None if not values or any(v is None for v in values) else max(values)


def job_startup(ranks: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The job's start-up from every rank's :func:`rank_marks` (pure); None when no rank has any mark.

    Returns ``{"marks": {mark: time}, "parts_s": {part: seconds}, "to_first_step_s", "first_step_s",
    "torch_import_s"}``; a figure that was not measured is None, and ``parts_s`` holds only measured parts.
    """
    if not ranks or not any(ranks):
        return None
    marks = {m: _latest(ranks, m) for m in MARKS}
    parts: dict[str, float] = {}
    # no launcher marks (a restarted group, or no launcher): from the first mark there is
    first = next((m for m in MARKS if marks[m] is not None), None)
    if first is None:
        return None
    origin = last = marks[first]
    for name, end, _ in PARTS:
        if marks[end] is not None and MARKS.index(end) > MARKS.index(first):
            parts[name] = max(marks[end] - last, 0.0)
            last = marks[end]
    imports = [r.get("torch_import_s") for r in ranks]
    return {
        "marks": marks,
        "parts_s": parts,
        "to_first_step_s": marks["first_step"] - origin if marks["first_step"] and origin else None,
        "first_step_s": (marks["first_step_end"] - marks["first_step"]
                         if marks["first_step_end"] and marks["first_step"] else None),
        "torch_import_s": None if any(v is None for v in imports) else max(imports),
    }
