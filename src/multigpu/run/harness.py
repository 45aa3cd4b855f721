"""The run harness: what happens to a run over time, written once for every workload (inside each rank).

A workload supplies its step and its state; the run does the rest::

    run = Run(ctx, {"model": model, "optim": opt, "rng": PerRank(RngState())}, total=cfg.steps,
              checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last, callbacks=cfg.callbacks)
    if run.resume_from:
        run.load()                      # the state's parts, from the checkpoint the run starts from
    for step in run.steps():            # the resumed step .. total - 1
        train_step(model, opt)          # the workload's own work, and nothing else
    summary = run.close({"loss": loss})

What the run owns:

* **the run directory** (``ctx.run_dir``; None: nothing is written) and ``summary.json`` in it (:meth:`close`,
  rank 0, from the step meter's reduced figures plus the workload's own);
* **resume**: a job's context comes decided by the rank entry point; a plain script's (no context, or one not
  decided) is decided here by the same function (:func:`multigpu.checkpoint.resume.decide`); :attr:`start`
  is the step of the checkpoint resumed from (its manifest's), and :meth:`steps` continues from there;
* **checkpoints**: one :class:`~multigpu.checkpoint.Checkpointer` (the store, ``keep_last``, the cadence
  ``checkpoint_every``, the background writer of ``mode="async"``); a checkpoint is written after every
  ``checkpoint_every``-th step, after the last step (``checkpoint_last``), after a step that asked to stop
  (:meth:`stop`) and after the step at which a signal arrived; the last write is on disk when
  :meth:`steps` ends;
* **the meter** (:class:`~multigpu.monitor.StepMeter`, from the context: run directory, device sampler,
  ``--profile``): each step is timed by :meth:`steps` (``timed=False``: the workload times the part of it
  that counts with ``run.meter.step()``); after each step its log point when one is due (every ``log_every``-th
  step as the run counts them, or a step the workload marks with ``run.meter.point()``), the one cadence of
  every workload's ``metrics.jsonl`` (:mod:`multigpu.monitor.metrics`);
* **callbacks**: objects with ``on_step(event)``, or ``pkg.module:factory`` names made here; after every step,
  on every rank, before that step's checkpoint, each gets one :class:`StepEvent`: the step (steps done), the
  state and the run;
* **signal-time checkpoints** (``on_interrupt``): Ctrl-C or SIGTERM is only recorded by the handler; at the
  next step boundary the ranks agree on it, the checkpoint of that step is written and the steps end
  (:mod:`multigpu.run.interrupt`; :attr:`interrupted`, :attr:`signal`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from multigpu.checkpoint import CHECKPOINTS, Checkpointer, CheckpointStore, PerRank, Sharded, read_manifest
from multigpu.checkpoint.resume import decide
from multigpu.errors import ConfigError
from multigpu.monitor import StepMeter
from multigpu.run.interrupt import InterruptFlag
from multigpu.runtime import context, group, progress

__all__ = ["Run", "StepEvent", "script_context"]


@dataclasses.dataclass(frozen=True)
class StepEvent:
    """What a callback's ``on_step(event)`` gets after each step, in every workload."""

    step: int
    """Steps done (the step just finished is number ``step``, counting from 1)."""
    state: Mapping[str, Any]
    """The workload's state: name -> part (``PerRank``/``Sharded`` wrappers taken off), e.g. ``"model"``."""
    run: Run
    """The run: its directory, checkpoints, meter."""


def script_context(run_dir: str | Path | None = None, resume: str | None = None) -> context.RunContext:
    """The run context of a plain script: the launcher's settings when it started the script (sampler,
    ``--profile``), the given folder (None: nothing is written) and ``resume`` ("auto", a checkpoint folder, or
    None), not decided yet (:class:`Run` decides it)."""
    return dataclasses.replace(context.current(), run_dir=str(run_dir) if run_dir is not None else None,
                               resume=resume, resume_from=None, resume_decided=False)


def _unwrapped(state: Mapping[str, Any] | None) -> dict[str, Any]:
    return {name: part.part if isinstance(part, (PerRank, Sharded)) else part for name, part in (state or {}).items()}


class Run:
    """One run on this rank; see the module docstring. Make it on every rank, after ``mg.init``.

    Args:
        ctx: The run context: a job's ``ctx`` (decided), or None for a plain script (:func:`script_context`).
        state: The workload's checkpoint parts (see :class:`~multigpu.checkpoint.CheckpointStore`); may be set
            later (``run.state = ...``), before the first checkpoint.
        total: The step to run to (:meth:`steps`'s default).
        checkpoint_every: A checkpoint every this many steps (0: none by cadence).
        keep_last: Checkpoints kept.
        mode: "async" (staged, then written in the background) or "sync" (written before the next step).
        checkpoint_last: Also a checkpoint after the last step.
        callbacks: Objects with ``on_step(event)``, and ``pkg.module:factory`` names (made here, no arguments).
        unit: The step meter's unit (:class:`~multigpu.monitor.StepMeter`). This and the four below are plain
            attributes too, read when the meter is first used.
        description: The progress bar's label.
        log_every: A log point every N steps (0: none by cadence; :mod:`multigpu.monitor.metrics`): the meter's
            figures reduced, rank 0 appends a record to ``metrics.jsonl``.
        warmup_steps: Steps left out of the summary.
        progress: Show the progress bar (on a terminal).
        on_interrupt: Ctrl-C/SIGTERM end the steps after the current one, with its checkpoint.
        meta: Plain JSON values for each checkpoint's manifest (a dict, or a function called at each save).
        before_save: Called with the step before each checkpoint (it may raise to prevent it).
    """

    def __init__(self, ctx: context.RunContext | None = None, state: dict[str, Any] | None = None, *,
                 total: int | None = None, checkpoint_every: int = 0, keep_last: int = 3, mode: str = "async",
                 checkpoint_last: bool = True, callbacks: Iterable[Any] = (), unit: str = "items",
                 description: str | None = None, log_every: int = 0, warmup_steps: int = 1, progress: bool = True,
                 on_interrupt: bool = False, meta: dict | Callable[[], dict] | None = None,
                 before_save: Callable[[int], None] | None = None):
        self.ctx = decide(ctx if ctx is not None else script_context())
        self.run_dir = Path(self.ctx.run_dir) if self.ctx.run_dir else None
        self.resume_from = Path(self.ctx.resume_from) if self.ctx.resume_from else None
        """The checkpoint this run continues from; None: a fresh run."""
        self.manifest: dict[str, Any] | None = read_manifest(self.resume_from) if self.resume_from else None
        """The manifest of the checkpoint resumed from (its ``step``, ``world_size`` and ``meta``; None: a fresh
        run): what a workload decides how to load by (another world size) before anything is read."""
        self.start = int(self.manifest["step"]) if self.manifest is not None else 0
        """The step this run starts from (the resumed checkpoint's; 0 for a fresh run)."""
        self.step = self.start
        """Steps done so far."""
        self.state = state
        self.total = total
        saves = checkpoint_every > 0 or checkpoint_last or on_interrupt
        self.checkpoints = Checkpointer(self.run_dir / CHECKPOINTS, every=checkpoint_every, keep_last=keep_last,
                                        mode=mode) if self.run_dir is not None and saves else None
        """The store, its cadence and its writer (None without a run directory, or for a run that never saves)."""
        self.checkpoint_last = checkpoint_last
        self.callbacks = [_made(c) for c in callbacks]
        self.unit, self.description, self.log_every = unit, description, log_every
        self.warmup_steps, self.progress = warmup_steps, progress
        self.on_interrupt = on_interrupt
        self.meta, self.before_save = meta, before_save
        self.interrupted = False
        """A signal ended the steps (every rank agreed on it)."""
        self.signal = 0
        """The signal the ranks agreed on (2: SIGINT, 15: SIGTERM; 0: none)."""
        self._stop: str | None = None
        self._meter: StepMeter | None = None
        self._count = None
        self._flag: InterruptFlag | None = None

    # ------------------------------------------------------------------ the meter
    @property
    def meter(self) -> StepMeter:
        """The step meter (made on first use, from the context and the attributes named in the class)."""
        if self._meter is None:
            total = self.total - self.start if self.total is not None else None
            self._meter = StepMeter.from_context(
                self.unit, self.ctx, total_steps=max(total, 0) if total is not None else None,
                description=self.description, log_every=self.log_every, warmup_steps=self.warmup_steps,
                progress=self.progress)
            self._meter.first_step = self.start + 1  # steps are named as the run counts them, after a resume too
            self._meter.ends_own_steps = False  # the log point comes after the workload's whole step (end_step)
        return self._meter

    def add_items(self, n: int) -> None:
        """Count ``n`` items (this rank's) into the step :meth:`steps` is timing."""
        if self._count is not None:
            self._count.items += int(n)

    # ------------------------------------------------------------------ resume
    def read(self, parts: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """A load's first step: what :attr:`resume_from` holds of ``parts`` (default: :attr:`state`), nothing applied.
        Call on all ranks.

        ``parts`` names the parts to read, and each one's kind says how: a :class:`~multigpu.checkpoint.PerRank`
        part is this rank's entry, any other plain part rank 0's value; a sharded part is read into the state by
        :meth:`apply` (DCP reads straight into this job's layout). Returns every value read by name, and
        ``"_manifest"`` (the checkpoint's step, world size and ``meta``): the workload can check them, or adapt
        them to this job (another world size), before anything is applied."""
        into = self.state if parts is None else parts
        return self._store().load(self.resume_from, {
            name: PerRank(None) if isinstance(part, PerRank) else None
            for name, part in (into or {}).items() if not isinstance(part, Sharded)})

    def apply(self, saved: Mapping[str, Any], into: Mapping[str, Any] | None = None) -> None:
        """A load's second step: each part of ``into`` (default: :attr:`state`) given its value from ``saved`` (what
        :meth:`read` returned, maybe adapted; ``load_state_dict``), and its sharded parts read from the checkpoint
        into this job's layout. Call on all ranks."""
        into = self.state if into is None else into
        sharded = {name: part for name, part in (into or {}).items() if isinstance(part, Sharded)}
        for name, part in (into or {}).items():
            part = part.part if isinstance(part, PerRank) else part
            if not isinstance(part, Sharded) and hasattr(part, "load_state_dict"):
                part.load_state_dict(saved[name])
        if sharded:
            self._store().load(self.resume_from, sharded)

    def load(self, into: dict[str, Any] | None = None) -> dict[str, Any]:
        """Restore ``into`` (default: :attr:`state`) from :attr:`resume_from`: :meth:`read`, then :meth:`apply`.
        Call on all ranks. Returns what :meth:`read` returned (every plain part's value, and ``"_manifest"``)."""
        saved = self.read(into)
        self.apply(saved, into)
        return saved

    def _store(self) -> CheckpointStore:
        if self.resume_from is None:
            raise ValueError("this run does not resume (resume_from is None): nothing to load")
        return CheckpointStore(self.resume_from.parent)

    # ------------------------------------------------------------------ the steps
    def steps(self, total: int | None = None, *, timed: bool = True) -> Iterator[int]:
        """Yield the number of each step still to run (from :attr:`step` to ``total - 1``); after each, the
        callbacks, a signal's agreement and the checkpoint happen here. Call on all ranks.

        ``timed``: time each step as one meter step (count items with :meth:`add_items`); False: the workload
        times its own (``with run.meter.step(): ...``). The last checkpoint is on disk when this ends."""
        if total is not None:
            self.total = total
        if self.total is None:
            raise ValueError("steps(): give the step to run to (Run(total=...) or steps(total))")
        if self.start > self.total:  # nothing would run, and the run would end as if it had
            raise ConfigError(f"--resume: {self.resume_from} is at step {self.start:,}, past the {self.total:,} steps "
                              f"this run is set to: nothing would run; valid: more steps than {self.start:,} (the "
                              "checkpoint's own total is in its run.json), or a new --run-dir without --resume")
        meter = self.meter
        with InterruptFlag(self.on_interrupt) as flag:
            self._flag = flag
            try:
                while self.step < self.total and self._stop is None:
                    number = self.step
                    if timed:
                        with meter.step() as count:
                            self._count = count
                            yield number
                        self._count = None
                    else:
                        yield number
                    self.step = number
                    self.end_step()
            finally:
                self._flag = None
        self.finish()

    @property
    def stop_requested(self) -> bool:
        """This rank got SIGINT or SIGTERM during :meth:`steps` (with ``on_interrupt``): the steps end after the
        current one, once the ranks agree at its end. A step that loops on its own may end its loop early."""
        return self._flag is not None and self._flag.requested

    def stop(self, why: str = "stopped") -> None:
        """End the steps after the current one, with its checkpoint (a target reached). Call on all ranks."""
        self._stop = why

    def end_step(self) -> None:
        """One more step done, and what :meth:`steps` does after each (callbacks, a signal's agreement, a
        checkpoint that is due). :meth:`steps` calls it; a loop that cannot be written as ``steps()`` (one whose
        length is found as it goes: a simulation ensemble's waves) calls it after each of its steps. Call on all
        ranks."""
        self.step += 1
        progress.finished(self.step)  # the launcher tells the other nodes (a lost node's last step is known)
        if self._meter is not None:  # its log point, when one is due: the figures reduced, rank 0 writes them
            self._meter.end_step(self.step)
        event = StepEvent(self.step, _unwrapped(self.state), self)
        for callback in self.callbacks:
            callback.on_step(event)
        flag = self._flag
        if flag is not None and flag.enabled and flag.agreed(group.current_device()):  # one tiny all-reduce
            self.interrupted, self.signal = True, flag.signum  # every rank stops after this same step
            self._stop = "interrupted"
        last = self.total is not None and self.step >= self.total
        if (self._stop is not None or (last and self.checkpoint_last) or
                (self.checkpoints is not None and self.checkpoints.due(self.step))):
            self.save()

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path | None:
        """Checkpoint :attr:`state` at :attr:`step` now (async: staged now, written in the background). Call on
        all ranks. None without a run directory or a state."""
        if self.checkpoints is None or self.state is None:
            return None
        if self.before_save is not None:
            self.before_save(self.step)
        meta = self.meta() if callable(self.meta) else self.meta
        if self.ctx.config is not None:  # the job's settings: a resume from this checkpoint alone is checked against them
            meta = {**(meta or {}), "config": self.ctx.config}
        return self.checkpoints.save(self.step, self.state, meta=meta)

    def finish(self) -> None:
        """The checkpoint being written is on disk (its error, if it failed, raised). Call on all ranks."""
        if self.checkpoints is not None:
            self.checkpoints.close()

    def close(self, extra: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None
              ) -> dict[str, Any]:
        """Finish, and have rank 0 write ``summary.json`` (the meter's figures and ``extra``). Call on all ranks.
        Returns the summary."""
        self.finish()
        return self.meter.close(extra)


def _made(callback: Any) -> Any:
    """A callback object; a ``pkg.module:factory`` name is called (no arguments) to make one."""
    if isinstance(callback, str):
        from multigpu.factory import call_factory

        return call_factory(callback, what="callbacks")
    return callback
