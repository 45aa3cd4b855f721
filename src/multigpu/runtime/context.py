"""The run context: what the launcher decided for this run, as one typed object (inside each rank).

The launcher writes one ``run.json`` per run and names it in the single
variable ``MULTIGPU_RUN_FILE``; every rank reads it here, once::

    {"workload": "train" | "pkg.module:WORKLOAD" | null,   # null: a user's script
     "config": {...},                                      # the workload's resolved config
     "run": {"run_dir": ..., "resume": ..., "scaling": ..., "profile": ..., "verify_dir": ..., ...}}

:class:`RunContext` is the ``run`` part. ``multigpu bench``, ``multigpu verify``
and a restarted worker group differ from a plain run only by the context they
get (another run directory, weak scaling, a verify folder, ``resume="auto"``);
the workload code is the same. A process started without the launcher
(``python script.py``, ``srun``, plain ``torchrun``) gets the defaults.

The variables that cross from the launcher into the workers, all of them, with
every other ``MULTIGPU_*`` name, are listed in :mod:`multigpu.envvars`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from multigpu import envvars
from multigpu.errors import ConfigError

__all__ = ["RESIZES_FILE", "RESTARTS_FILE", "RUN_FILE_VAR", "RunContext", "current", "read_resizes", "read_restarts", "read_run_file",
           "set_current"]

RUN_FILE_VAR = envvars.RUN_FILE
"""The one variable through which the launcher tells a rank about its run."""


"""Set by the launcher of a one-node job: a 0700 folder where ``init()`` ranks meet, one FileStore per attempt
(not the workers' TCP store, which any local user can reach)."""

SCALINGS = ("strong", "weak")

RESTARTS_FILE = "restarts_node{node}.jsonl"
"""In the run folder: one JSON line per rank that died and made torchrun's agent restart the worker group
(``--max-restarts``), written by that node's launcher (rank, node, host, exit code or signal, reason); the
run's ``summary.json`` lists them under ``restarts``."""


RESIZES_FILE = "resizes.jsonl"
"""In the run folder: one JSON line per resume at another world size (from, to, step, the check of the state
loaded against the one saved), written by rank 0 (:mod:`multigpu.checkpoint.resize`); the run's ``summary.json``
lists them under ``resizes``."""


def _records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a file of one record a line; a torn or foreign line, or a file not there, gives none."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def read_resizes(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every resize recorded in ``run_dir``, in order."""
    return _records(Path(run_dir) / RESIZES_FILE)


def read_restarts(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every rank death recorded in ``run_dir`` by the launchers (all nodes), in time order."""
    records = [r for path in sorted(Path(run_dir).glob(RESTARTS_FILE.format(node="*"))) for r in _records(path)]
    return sorted(records, key=lambda r: (str(r.get("time", "")), r.get("restart", 0), r.get("rank", 0)))


MAX_TIMEOUT_S = 1e9
"""The longest collective or stall timeout, in seconds (31 years: no timeout, in effect). torch's and gloo's deadlines
(now + timeout, counted in nanoseconds) overflow past about 9.2e9 s, and every wait then ends at once ("Timed out
waiting 10000000000000ms"); a longer timeout is clamped to this (:func:`clamp_timeout`)."""


def clamp_timeout(value: float | None) -> float | None:
    """``value`` seconds, at most :data:`MAX_TIMEOUT_S` (None stays None)."""
    return None if value is None else min(value, MAX_TIMEOUT_S)


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """Where a run writes, what it resumes, and how it is measured. Frozen: derive with ``replace``."""

    run_dir: str | None = None
    """Folder for the run's outputs (metrics, summary, checkpoints); None: write nothing."""
    resume: str | None = None
    """What the user asked for (``--resume``): None: start fresh; "auto": the newest valid checkpoint of
    ``run_dir``; or a checkpoint path. Workloads read :attr:`resume_from` instead."""
    resume_from: str | None = None
    """The checkpoint this attempt starts from (None: from scratch), decided once by the rank entry point
    from ``resume`` and, for a worker group restarted by torchrun's agent, the run's newest valid checkpoint
    (:func:`multigpu.checkpoint.resolve`)."""
    resume_decided: bool = False
    """Whether :attr:`resume_from` is decided (by the rank entry point, or by the run harness for a plain
    script: :func:`multigpu.checkpoint.resume.decide`), so that nothing decides it twice."""
    scaling: str = "strong"
    """"strong": the global problem is fixed; "weak": it grows with the world size (``multigpu bench --weak``)."""
    profile: bool = False
    """Record a torch.profiler trace per rank for ``profile_steps`` (``--profile``)."""
    profile_steps: tuple[int, int, int] = (1, 1, 3)
    """The profiler's window: steps to skip, to warm up, to record."""
    verify_dir: str | None = None
    """Where ``mg.verify.record`` saves named results (``multigpu verify``); None: it records nothing."""
    timeout_s: float | None = None
    """Collective timeout (``--timeout-s``); None: ``mg.init``'s default."""
    stall_timeout_s: float | None = None
    """End the job when a rank makes no progress for this long (``--stall-timeout-s``)."""
    sample_interval_s: float = 1.0
    """Seconds between the device sampler's records in the run directory; 0: no sampler."""
    isolated: bool = False
    """Each worker sees only its own GPU (``--isolate-devices``): its device is ``cuda:0``."""
    allow_cpu_ranks: bool = False
    """Ranks beyond the GPU count run on the CPU (``--allow-cpu-ranks``)."""
    hybrid: bool = False
    """Some rank of the job runs on the CPU, so every rank uses gloo."""
    pg_backend: str | None = None
    """The process-group backend the launcher chose ("gloo" when ranks share a GPU); None: by the devices."""
    record_wall: bool = False
    """The worker wrapper writes when the script started and ended (``multigpu bench`` on any script)."""
    elastic: bool = False
    """The worker group may re-form at another size (``--nnodes MIN:MAX``): every start of it continues the run
    from its newest valid checkpoint, as a restart does, and a resume at another world size is recorded
    (:data:`RESIZES_FILE`)."""
    resume_command: str | None = None
    """The whole command that continues this run (the job's own flags, ``--run-dir`` this folder,
    ``--resume auto``), for a workload that stops early to print; None: not launched from a command line."""
    config: dict[str, Any] | None = None
    """The job's resolved config as ``run.json`` holds it, set by the rank entry point (None in ``run.json``'s run
    context, and for a plain script): every checkpoint the run harness writes records it in its manifest
    (``meta.config``), so that a resume from a checkpoint found anywhere, its run folder gone, is checked against
    the settings that wrote it (what the workload keeps: ``Workload.resume_keeps``)."""

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ConfigError(f"run.scaling {self.scaling!r} is invalid; valid: {', '.join(SCALINGS)}")
        steps = tuple(self.profile_steps)
        if len(steps) != 3 or not all(isinstance(s, int) and s >= 0 for s in steps) or steps[2] < 1:
            raise ConfigError(f"run.profile_steps {list(steps)} is invalid; valid: [wait, warmup, active] "
                              "whole numbers, active >= 1, e.g. [1, 1, 3]")
        object.__setattr__(self, "profile_steps", steps)
        for name in ("timeout_s", "stall_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ConfigError(f"run.{name}={value!r} is invalid; valid: a number of seconds > 0")
            object.__setattr__(self, name, clamp_timeout(value))
        if self.pg_backend not in (None, "gloo", "nccl"):
            raise ConfigError(f"run.pg_backend={self.pg_backend!r} is invalid; valid: gloo, nccl, or null")
        if not (math.isfinite(self.sample_interval_s) and self.sample_interval_s >= 0):
            raise ConfigError(f"run.sample_interval_s={self.sample_interval_s!r} is invalid; valid: seconds >= 0")

    def problem_scale(self, world_size: int) -> int:
        """How many times larger the global problem is: ``world_size`` under weak scaling, else 1.

        A workload multiplies its global size (agents, images, environments) by this,
        so each rank's share stays the same as the world grows.
        """
        return world_size if self.scaling == "weak" else 1

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["profile_steps"] = list(self.profile_steps)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunContext:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"run context: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        return cls(**{k: tuple(v) if k == "profile_steps" else v for k, v in data.items()})


def read_run_file(path: str | Path) -> dict[str, Any]:
    """The launcher's ``run.json``: ``{"workload", "config", "run"}``. One-line ConfigError when unreadable."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"run file '{path}' cannot be read: {exc.strerror or exc}") from None
    except ValueError:
        raise ConfigError(f"run file '{path}' is not valid JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("run", {}), dict):
        raise ConfigError(f"run file '{path}' must hold {{'workload', 'config', 'run'}}")
    return data


_CURRENT: RunContext | None = None


def set_current(ctx: RunContext | None) -> None:
    """Make ``ctx`` this process's run context (the rank entry point does; None: read the launcher's again)."""
    global _CURRENT
    _CURRENT = ctx


def current() -> RunContext:
    """This rank's run context: the launcher's (``MULTIGPU_RUN_FILE``), else the defaults. Read once."""
    global _CURRENT
    if _CURRENT is None:
        path = os.environ.get(RUN_FILE_VAR)
        ctx = RunContext.from_dict(read_run_file(path).get("run", {})) if path else RunContext()
        _CURRENT = ctx
    return _CURRENT
