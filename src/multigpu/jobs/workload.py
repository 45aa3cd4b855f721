"""The job contract: what a workload is (read on both sides of the launch).

A workload is three things::

    WORKLOAD = Workload(
        name="sim",
        config=SimConfig,                  # a frozen dataclass: YAML + key=value overrides
        check=check,                       # check(cfg, plan) -> cfg | None   in the launcher, before anything spawns
        main=main,                         # main(cfg, ctx) -> exit code       inside every rank
    )

The command line, the run directory, ``run.json``, ``mg.init`` and
``mg.shutdown`` are the contract's (:mod:`multigpu.jobs.command`,
:mod:`multigpu.jobs.rank`); ``multigpu bench``, ``multigpu verify`` and
restarts only hand ``main`` another :class:`~multigpu.runtime.context.RunContext`.
``multigpu run pkg.module:WORKLOAD`` runs a workload defined anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import DevicePlan
from multigpu.runtime.context import RunContext

__all__ = ["Flag", "JobPlan", "Workload"]


@dataclass(frozen=True)
class JobPlan:
    """What ``check`` may rely on: the launch, this node's device plan (made once), the world size, the run
    context."""

    launch: LaunchConfig
    devices: DevicePlan
    world_size: int
    """Ranks in the whole job (``nproc_per_node × nnodes``)."""
    ctx: RunContext
    """The run context (run directory, resume, scaling): the one ``main(cfg, ctx)`` gets in every rank."""

    @property
    def device_types(self) -> list[str]:
        """The device types of this node's ranks: ["cuda"], ["cpu"] or both (a hybrid job)."""
        return self.devices.device_types


@dataclass(frozen=True)
class Flag:
    """A command-line shortcut for a config key: ``Flag("--agents", "agents", type=int)`` makes
    ``--agents N`` mean ``agents=N`` (later than the file, earlier than positional overrides)."""

    name: str
    key: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __init__(self, name: str, key: str, **kwargs: Any):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "kwargs", kwargs)


@dataclass(frozen=True)
class Workload:
    """One kind of job: its config class, its launcher-side ``check`` and its rank-side ``main``."""

    name: str
    """The command (``multigpu <name>``) and the run folder (``runs/<name>/``)."""
    config: type
    """A frozen dataclass; its fields are the keys of ``-f FILE`` and of ``key=value`` overrides."""
    main: Callable[[Any, RunContext], int | None]
    """Runs inside every rank after ``mg.init``; returns the exit code (None = 0)."""
    check: Callable[[Any, JobPlan], Any] | None = None
    """Runs once in the launcher before anything is written or spawned; raises ConfigError on bad input.
    May return a completed config (paths made absolute, say); None keeps the one it got."""
    init: Callable[[Any], dict[str, Any]] | None = None
    """``mg.init`` keyword arguments from the config (seed, backend, threads); None: the defaults."""
    help: str = ""
    """One line for ``multigpu --help``."""
    preset: str | None = None
    """The packaged preset used when no ``-f`` is given (None: the config class's defaults)."""
    prefix: str = ""
    """Prefix of config keys in messages (``sim.agents``)."""
    flags: tuple[Flag, ...] = ()
    """Command-line shortcuts for config keys."""
    bench: tuple[str, ...] = ()
    """Overrides ``multigpu bench <name>`` adds (shorter runs, no plots), before the user's own."""
    command: bool = True
    """Has its own command (``multigpu <name>``); False: only ``multigpu bench <name>`` runs it."""
    resumable: bool = False
    """``main`` continues from ``ctx.resume_from`` (a checkpoint of :class:`multigpu.checkpoint.CheckpointStore`);
    False: ``--resume`` is refused in one line before anything starts, and a restarted worker group starts over."""
    resume_keeps: tuple[str, ...] = ()
    """Config keys (or sections) a resumed run must keep: ``--resume`` starts from the run's own ``run.json``
    config, and a key given again with another value is refused in one line naming it (other keys given
    again are applied: more steps, say)."""
    resume_total: Callable[[Any], int | None] | None = None
    """The step a run of this config counts to (its run harness's ``total``: train's ``steps``), so that a resume
    from a checkpoint already past it (nothing would run) is refused in one line before anything starts; None (or
    None from it): not checked in the launcher (the run harness refuses it in the ranks)."""
    preload: tuple[str, ...] = ()
    """Modules its ranks import before their first step besides ``main``'s own (``torch._dynamo``, which a
    ``torch.optim`` optimizer imports when it is made): the command line's fork server imports them once, while
    the launcher checks the config, instead of every rank (:func:`multigpu.launch.forkserver.preload`)."""
    own_progress: Callable[[Path], bool] | None = None
    """For a workload whose runs may keep their progress in files of their own instead of checkpoints (sim's
    ensembles: one file per finished replicate), whether a run folder holds such progress. ``--resume auto``
    without ``--run-dir`` then takes the newest run with a checkpoint or with that, and the rank entry point leaves
    what a run continues to ``main`` (``ctx.resume_from`` undecided): a run that writes checkpoints decides it
    through its :class:`~multigpu.run.Run` (the rule of :func:`multigpu.checkpoint.resume.decide`), one that
    continues files of its own reads ``ctx.resume`` and checks them itself (in ``check`` too)."""
    dry_run: Callable[[Any, JobPlan, int, Any], None] | None = None
    """The workload's part of ``--dry-run --world-size N`` (:mod:`multigpu.jobs.dryrun`), in the launcher:
    ``dry_run(cfg, plan, rank, report)`` adds to ``report`` what rank ``rank`` of ``plan.world_size`` holds (its
    samples, agents, windows) and its memory, measured on fake tensors where it can; None: the check runs and
    memory is not measured."""
    launch: Callable[[Any], int | None] | None = None
    """``launch(job)`` in the launcher, after the check and the run directory: returns an exit code when it
    ran the job its own way (sim's ``--check-split`` launches at 1 and 2 ranks and compares), None to
    launch it once as usual."""
