"""The data-parallel Trainer (inside each rank): a strategy (DDP, FSDP, HSDP), accumulation, precision, checkpoints.

Every rank builds the same model and optimizer, then::

    trainer = Trainer(model, optimizer, train_set, config=cfg, val_data=val_set, scheduler=sched)
    trainer.setup()      # device, the strategy's wrapping, data, lr scaling, resume; prints the effective batch
    trainer.fit()        # until cfg.steps: train_step, evaluate, log, checkpoint
    trainer.close()      # summary.json (via StepMeter) on rank 0

Checkpoints, resume, the step meter (its log points: ``metrics.jsonl``), callbacks and ``summary.json`` belong
to the run harness (:class:`multigpu.run.Run`, made by ``setup()``); the trainer hands it its state, as its
strategy names the parts (model, optimizer, trainer state, every rank's random state; under fsdp and hsdp the
tensors as DCP shards, which resume on any layout and strategy; a ddp checkpoint resumes under ddp only). Checkpoints are ``<run_dir>/checkpoints/step_*``
(every ``checkpoint_every`` steps and after the last), written in the background with
``checkpoint_mode=async`` (the default). A job's context comes with its resume decided; a plain script gives
``resume`` ("auto" or a path) and the run decides it by the same rule, so a worker group that torchrun's agent
restarts (``--max-restarts``) resumes from the run's newest valid checkpoint whatever ``resume`` says (the
given ``resume`` is used only when the run has no checkpoint yet).

Callbacks: objects with an ``on_step(event)`` method, called on every rank after each optimizer step (after its
validation and its log point) and before its checkpoint, with one :class:`multigpu.run.StepEvent`:

* ``event.step``: optimizer steps done;
* ``event.state``: the checkpoint's parts (wrappers taken off): ``"model"`` (the module, on the device) and
  ``"optimizer"`` under ddp, ``"tensors"`` under fsdp and hsdp (:class:`~multigpu.train.strategies.FsdpTensors`:
  its ``.module``, the sharded module, and ``.optimizer``), ``"rng"``, and ``"trainer"`` (its ``state_dict()``
  is the step, the scheduler's, the scaler's and the sampler's state, and the config);
* ``event.run``: the :class:`~multigpu.run.Run` (its ``meter``, ``checkpoints``, ``run_dir``).

They are given as objects (``callbacks=[...]``, or appended to ``trainer.callbacks``) or, in the config, as
``pkg.module:factory`` names (``TrainConfig.callbacks``) that the run calls with no arguments. With
``checkpoint_on_interrupt``, Ctrl-C or SIGTERM on the launcher (or on the ranks)
ends ``fit()`` after the current step with a checkpoint on every rank's agreement
(see :mod:`multigpu.run.interrupt`); ``fit()`` then returns ``interrupted: True``
and the agreed ``signal`` (2 or 15).

The model is moved to the device in place, so an optimizer built on
``model.parameters()`` before ``setup()`` keeps working. ``loss_fn(model, batch)``
defaults to cross-entropy of ``model(x)`` against ``y`` for a batch ``(x, y)``
(logits ``(..., classes)``, targets ``(...)``).

How the model is spread over the ranks is its strategy's (:mod:`multigpu.train.strategies`, ``trainer.strategy``,
Lightning Fabric's shape): ``strategy="ddp"`` replicates it (DDP's all-reduce in backward), ``"fsdp"`` shards
parameters, gradients and optimizer state (the optimizer is re-pointed at the sharded parameters in ``setup()``),
``"hsdp"`` shards within groups of ``hsdp_shard_size`` ranks (default: a node's) and replicates across them. The
trainer asks it to wrap the model, for the context of accumulation micro-steps, to clip, for the checkpoint's parts
and for the validation batches; it never tests the strategy's name. With world_size 1 nothing is wrapped;
everything else is the same code.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

import multigpu as mg
from multigpu.checkpoint import PerRank, RngState
from multigpu.errors import ConfigError
from multigpu.run import Run, script_context
from multigpu.runtime import context
from multigpu.train.checkpoint import check_model_fits, restore_rng
from multigpu.train.config import TrainConfig, lr_scale_factor
from multigpu.train.finite import FiniteGuard
from multigpu.train.loader import BatchStream, to_device
from multigpu.train.precision import autocast, check_precision, probe_support
from multigpu.train.strategies import Strategy, strategy_for
from multigpu.train.trackers import Trackers, console_line

__all__ = ["Trainer", "count_items", "default_loss"]


def default_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """The loss of one batch: ``(x, y)`` -> cross-entropy of ``model(x)`` against ``y``; a dict (Hugging Face
    style: ``input_ids``, ``labels``, ...) -> ``model(**batch)``.

    What the model returns:

    * an output with a ``loss`` that is not None (Hugging Face models given labels): that loss, as it is;
    * an output with ``logits``, or a tensor: the logits, scored against the targets;
    * a tuple or list (nanoGPT's ``(logits, loss)``, Hugging Face's ``return_dict=False``): a 0-dim tensor in it
      is the loss, as it is; otherwise its first tensor is the logits.

    A model whose ``forward`` takes ``targets`` (nanoGPT's and minGPT's ``forward(idx, targets=None)``) is called
    as ``model(x, targets=y)``: called without them, nanoGPT computes the logits of the last position only, which
    no loss can score against every target. Any other loss: ``--loss pkg.module:fn`` with ``fn(model, batch)``.
    """
    if isinstance(batch, dict):
        out, target = model(**batch), batch.get("labels")
    else:
        x, target = batch
        out = model(x, targets=target) if _takes_targets(type(_unwrapped(model))) else model(x)
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    logits = getattr(out, "logits", out)
    if isinstance(logits, (tuple, list)):
        tensors = [t for t in logits if isinstance(t, torch.Tensor)]
        scalar = next((t for t in tensors if t.dim() == 0), None)
        if scalar is not None:
            return scalar
        logits = next(iter(tensors), logits)
    if not isinstance(logits, torch.Tensor):
        raise ConfigError(f"the model returned {type(out).__name__}, and the default loss needs logits: a tensor, "
                          "an output with .logits or .loss, or a tuple whose first tensor is the logits; valid: "
                          "return one of those, or give a loss function (--loss pkg.module:fn, fn(model, batch))")
    if target is None:
        raise ConfigError("the batch has no targets (no 'labels' key) and the model returned no loss; "
                          "give labels in the batch, or a loss function (--loss pkg.module:fn)")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module under DDP's (``module``) and ``torch.compile``'s (``_orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "_orig_mod", None) or getattr(model, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


@functools.lru_cache(maxsize=64)
def _takes_targets(cls: type) -> bool:
    """Whether ``cls.forward`` has a parameter named ``targets`` (nanoGPT's GPT)."""
    try:
        return "targets" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def count_items(batch: Any, unit: str) -> int:
    """Items in a batch: "samples" = its first dimension; "tokens" = the real tokens of its inputs (the
    ``attention_mask``'s ones when there is one, else every element of ``input_ids`` or of the first tensor)."""
    first = batch
    if isinstance(batch, dict):
        first = batch.get("input_ids", next(iter(batch.values())))
        if unit == "tokens" and isinstance(batch.get("attention_mask"), torch.Tensor):
            return int(batch["attention_mask"].sum())
    elif isinstance(batch, (tuple, list)):
        first = batch[0]
    if not isinstance(first, torch.Tensor):
        return len(first) if unit == "samples" else 1
    return int(first.numel()) if unit == "tokens" else int(first.shape[0])


class Trainer:
    """Trains ``model`` with ``optimizer`` on ``train_data`` across all ranks; see the module docstring.

    Args:
        model: The plain model (not yet on the device, not wrapped in DDP), or one built on the ``meta`` device
            (``multigpu.train.meta.build_on_meta``): under fsdp/hsdp each rank then materializes only its shards,
            otherwise the whole model on this rank (see :mod:`multigpu.train.meta` for how values are made).
        optimizer: Built on ``model.parameters()``.
        train_data: A map-style dataset; each rank reads its share through ``mg.TrainSampler``.
        config: The knobs (``TrainConfig``); ``model``/``data`` sections are not used here.
        val_data: Optional dataset for ``evaluate()``.
        scheduler: Optional LR scheduler, stepped once per optimizer step.
        loss_fn: ``loss_fn(model, batch) -> scalar loss``.
        run_dir: Where rank 0 writes metrics, summary and checkpoints (None: no files). In a script
            started by ``multigpu launch``/``bench``, ``mg.run_context().run_dir`` is the launcher's choice.
        resume: In a plain script: None: start fresh; "auto": the newest valid checkpoint in ``run_dir``,
            if any; or a checkpoint folder (decided in ``setup()`` by the run harness, restarts included).
        ctx: The run context of a job (its ``main(cfg, ctx)``'s: ``resume_from`` decided; ``run_dir`` and
            ``resume`` are then not looked at); None: a plain script. (``trainer.run`` is the run harness made
            from it.)
        callbacks: Objects whose ``on_step(event)`` runs on every rank after every optimizer step, with a
            :class:`multigpu.run.StepEvent` (see the module docstring for what it holds).
        unit: "tokens" (the real tokens of each batch: see :func:`count_items`) or "samples" (its first dim).
        collate_fn: Passed to the DataLoader.
        shard_data: True: ``train_data`` is the whole dataset, split equally over ranks by
            ``mg.TrainSampler``. False: ``train_data`` is this rank's own shard (the user split it);
            lengths may differ between ranks, and every epoch then runs the shortest rank's
            number of batches on every rank (no rank waits forever in the gradient all-reduce).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Dataset,
        *,
        config: TrainConfig | None = None,
        val_data: Dataset | None = None,
        scheduler: Any = None,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] = default_loss,
        run_dir: str | Path | None = None,
        unit: str = "tokens",
        collate_fn: Callable | None = None,
        shard_data: bool = True,
        resume: str | None = None,
        callbacks: list[Any] | None = None,
        ctx: context.RunContext | None = None,
    ):
        self.config = config or TrainConfig()
        self.module, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.train_data, self.val_data, self.loss_fn = train_data, val_data, loss_fn
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.resume = resume
        self._ctx = ctx
        self.run: Run | None = None
        """The run harness (made by ``setup()``): checkpoints, resume, meter, callbacks, summary."""
        self._callbacks = list(callbacks or [])
        self.unit, self.collate_fn, self.shard_data = unit, collate_fn, shard_data
        self.skipped_steps = 0
        """Optimizer steps skipped for a non-finite gradient norm (``nonfinite=skip``)."""
        self._step = 0
        self.model: torch.nn.Module = model
        self.last_val_loss: float | None = None
        self.first_step_at: float | None = None
        """When the first optimizer step of this run ended (wall clock)."""
        self.trackers = Trackers([], unit)
        """TensorBoard, W&B (``config.logger``): rank 0's, opened by ``setup()``."""
        self.strategy: Strategy | None = None
        """How the model is spread over the ranks (made by ``setup()``): :mod:`multigpu.train.strategies`."""
        self._is_setup = False

    # ----------------------------------------------------------------- what the run holds
    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.run.step if self.run is not None else self._step

    @step.setter
    def step(self, value: int) -> None:
        if self.run is not None:
            self.run.step = value
        else:
            self._step = value

    @property
    def callbacks(self) -> list:
        """The callbacks (``setup()`` adds the config's); append to it to add one."""
        return self.run.callbacks if self.run is not None else self._callbacks

    @property
    def meter(self):
        return self.run.meter

    @property
    def checkpoints(self):
        """The run's :class:`~multigpu.checkpoint.Checkpointer` (None without a run directory)."""
        return self.run.checkpoints

    @property
    def interrupted(self) -> bool:
        return self.run is not None and self.run.interrupted

    @property
    def interrupt_signal(self) -> int:
        return self.run.signal if self.run is not None else 0

    # ----------------------------------------------------------------- setup
    def setup(self) -> Trainer:
        """Place and wrap the model (its strategy), build the data stream, apply lr scaling, resume. Call on all
        ranks."""
        self.env = mg.get_env("Trainer.setup")
        cfg = self.config
        ctx = self._ctx if self._ctx is not None else script_context(self.run_dir, self.resume)
        self.run = Run(ctx, total=cfg.steps, checkpoint_every=cfg.checkpoint_every, keep_last=cfg.keep_last,
                       mode=cfg.checkpoint_mode, callbacks=[*self._callbacks, *cfg.callbacks], unit=self.unit,
                       description="train", log_every=cfg.log_every, on_interrupt=cfg.checkpoint_on_interrupt,
                       before_save=self._check_finite)
        self.run_dir = self.run.run_dir
        self.world_size = self.env.world_size
        self.accum = self.config.accum_per_rank(self.world_size)
        self.batch_size = self.config.batch_per_rank(self.world_size)
        self.effective_batch = self.batch_size * self.accum * self.world_size
        self.items_per_sample = self._items_per_sample()
        self._setup_precision()
        self._setup_model()
        saved = self._read_checkpoint()  # a resume in two steps: read (checked, fitted to this job), then apply
        if saved is not None:
            saved["trainer"]["sampler"] = self._sampler_for_this_job(saved)
        self._setup_data(saved["trainer"] if saved is not None else None)
        self._setup_lr()
        if saved is not None:
            self._load_state(saved)
        self.run.state, self.run.meta = self._checkpoint_parts()
        self._setup_logging()
        self._is_setup = True
        return self

    def _setup_precision(self) -> None:
        cfg, dev = self.config, self.env.device
        check_precision(cfg.precision, cfg.dtype, probe_support(dev.type))
        if dev.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
            torch.backends.cudnn.allow_tf32 = cfg.tf32
            torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
        self.scaler = torch.amp.GradScaler(dev.type, enabled=cfg.precision == "fp16")
        self.finite = FiniteGuard(dev, scaler_skips=self.scaler.is_enabled())

    def _setup_model(self) -> None:
        optimized = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if not optimized <= {id(p) for p in self.module.parameters()}:
            raise ConfigError("the optimizer holds tensors that are not parameters of the model; "
                              "build it with the model's own parameters, e.g. AdamW(model.parameters())")
        self.strategy = strategy_for(self.config, self.env, hybrid=context.current().hybrid)
        self.autocast_precision = self.strategy.autocast_precision
        # in place: the optimizer keeps its parameters (or is pointed at the sharded ones); the starting weights
        # are loaded where every rank holds what it reads
        self.model = self.strategy.setup(self.module, self.optimizer, init=self._load_pretrained)

    def _load_pretrained(self) -> None:
        """``init_from``: each rank reads its own rows of every parameter (all of them when not sharded)."""
        if self.config.init_from:
            from multigpu.train.pretrained import load_weights

            load_weights(self.module, self.config.init_from)

    def _setup_data(self, state: dict | None) -> None:
        cfg = self.config
        self.batches = BatchStream(
            self.train_data, self.batch_size, device=self.env.device, seed=cfg.seed, num_workers=cfg.num_workers,
            prefetch=cfg.prefetch, collate_fn=self.collate_fn, sampler_state=state["sampler"] if state else None,
            shard=self.shard_data, pin_memory=cfg.pin_memory,
        )
        self.sampler_state = self.batches.sampler.state_dict()

    def _setup_lr(self) -> None:
        cfg = self.config
        factor = lr_scale_factor(cfg.lr_scaling, self.effective_batch, cfg.ref_batch_size)
        self.lr_factor = factor
        if factor != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] *= factor
                if "initial_lr" in g:
                    g["initial_lr"] *= factor
            if self.scheduler is not None and hasattr(self.scheduler, "base_lrs"):
                self.scheduler.base_lrs = [lr * factor for lr in self.scheduler.base_lrs]

    def _setup_logging(self) -> None:
        cfg = self.config
        self.run.warmup_steps = min(2, max(cfg.steps - self.step - 1, 0))  # before the meter is made
        self.trackers = Trackers(self._open_trackers() if mg.is_main() else [], self.unit)
        self.meter.on_record.append(self._logged)
        if mg.is_main():
            self._print_plan()

    def _logged(self, record: dict[str, Any]) -> None:
        """After each log point of the run's meter, on every rank: rank 0 prints the line and feeds the trackers;
        the log point synchronised already, so one more number says whether any step went non-finite."""
        if mg.is_main():
            print(console_line(record, self.config.steps, self.unit), flush=True)
            self.trackers.log(record)
        self.finite.check(record["step"], None if self.checkpoints is None else
                          "the checkpoints written before it are kept")

    def _open_trackers(self) -> list:
        """TensorBoard, W&B (``config.logger``) on rank 0; W&B gets the resolved config and the job's shape."""
        from multigpu.train.trackers import open_trackers

        cfg = self.config
        shape = {"world_size": self.world_size, "effective_batch": self.effective_batch}
        return open_trackers(cfg.logger, self.run_dir, wandb=cfg.wandb, config={**_plain(cfg), **shape},
                             fresh=self.step == 0)

    def _print_plan(self) -> None:
        cfg = self.config
        items = f" ({self.effective_batch * self.items_per_sample:,} {self.unit})" if self.unit == "tokens" else ""
        print(f"effective batch: batch {self.batch_size} × grad_accum {self.accum} × world_size "
              f"{self.world_size} = {self.effective_batch} samples{items} per step", flush=True)
        if self.lr_factor != 1.0:
            print(f"lr scaling ({cfg.lr_scaling}): lr {cfg.lr:g} × {self.lr_factor:.4g} "
                  f"(effective batch {self.effective_batch} / ref_batch_size {cfg.ref_batch_size}) "
                  f"= {cfg.lr * self.lr_factor:.4g}", flush=True)
        sync = cfg.sync_backend if self.world_size > 1 else "none (world_size 1)"
        print(f"device {self.env.device}, precision {cfg.precision}, dtype {cfg.dtype}, gradient sync {sync}"
              + (f"; resumed at step {self.step}" if self.step else ""), flush=True)
        plan, how = self.strategy.memory_plan(self.module)
        print(f"training state per rank (planned, strategy {cfg.strategy}: {how}): parameters "
              f"{_mib(plan['params'])}, gradients {_mib(plan['grads'])}, optimizer (Adam) {_mib(plan['optimizer'])}"
              f" = {_mib(sum(plan.values()))}", flush=True)

    # ----------------------------------------------------------------- resume
    def _read_checkpoint(self) -> dict | None:
        """A resume's first step: what the run's checkpoint holds (the parts its layout has: whole state dicts,
        or a sharded checkpoint's plain parts), nothing applied yet. Another model's checkpoint is one line here,
        not ``load_state_dict``'s page of mismatches (a sharded one's shapes are DCP's, checked as it loads)."""
        path = self.run.resume_from  # decided by the run: a job's, or a plain script's resume
        if path is None:
            return None
        saved = self.run.read(self.strategy.checkpoint_reads(path))
        if "model" in saved:
            check_model_fits(path, {"model": saved["model"], "config": saved["trainer"].get("config")}, self.module,
                             _plain(self.config))
        return saved

    def _sampler_for_this_job(self, saved_parts: dict) -> dict:
        """The saved sampler position, moved to this job's world size.

        Ranks take strided slices of one permutation, so ``offset`` samples on each of W ranks are the
        first ``offset × W`` samples of the epoch; on W' ranks that is ``offset × W / W'`` each."""
        saved, sampler = saved_parts["_manifest"]["world_size"], dict(saved_parts["trainer"]["sampler"])
        if saved == self.world_size:
            return sampler
        consumed = sampler["offset"] * saved
        if consumed % self.world_size:
            raise ConfigError(f"the checkpoint was written by {saved} ranks at sample {consumed} of its epoch, which "
                              f"does not split over {self.world_size} ranks; valid: a world size dividing {consumed}")
        sampler["offset"] = consumed // self.world_size
        return sampler

    def _load_state(self, saved: dict) -> None:
        """A resume's second step: the tensors (the strategy's: whole state dicts, or each rank its own shards,
        resharded from the saving job's layout), then the trainer's own state and this rank's random state."""
        self.strategy.restore(self.run, saved, self.module, self.optimizer)
        state, world_size = saved["trainer"], saved["_manifest"]["world_size"]
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        self.sampler_state = state["sampler"]
        if world_size != self.world_size and mg.is_main():
            print(f"note: checkpoint was written by {world_size} rank(s), this job has {self.world_size}; "
                  "random streams are re-used by rank modulo", flush=True)
        restore_rng(saved["rng"])  # this rank's (rank modulo the saving job's size)
        from multigpu.checkpoint.resize import resized_from

        before = resized_from(self.run.run_dir, world_size, self.world_size)
        if before is not None:
            self._record_resize(saved, before)

    def _fingerprint(self) -> dict[str, list[float]]:
        """The model's and the optimizer's tensors, summed over the job (:mod:`multigpu.checkpoint.resize`)."""
        from multigpu.checkpoint.resize import fingerprint

        return fingerprint({"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict().get("state")})

    def _record_resize(self, saved_parts: dict, before: int) -> None:
        """A resume at another world size: check that the state loaded is the state saved, and record it (from N
        to M ranks, the step, the check) in the run folder; rank 0 says it in one line."""
        from multigpu.checkpoint.resize import compare, recorded

        loaded = self._fingerprint()  # a collective: every rank
        saved = (saved_parts["_manifest"].get("meta") or {}).get("fingerprint")
        check = compare(saved, loaded) if isinstance(saved, dict) else None
        if mg.is_main():
            print(recorded("train", self.run.run_dir, from_ranks=before, to_ranks=self.world_size,
                           step=self.step, checkpoint=self.run.resume_from, check=check), flush=True)

    def state_dict(self) -> dict[str, Any]:
        """Everything but the RNG states (which the checkpoint gathers from every rank).

        Under fsdp ``model`` and ``optimizer`` hold this rank's shards (DTensors)."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(), **self._run_state()}

    def _run_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "sampler": self.sampler_state,
            "config": _plain(self.config),
        }

    def _checkpoint_parts(self) -> tuple[dict[str, Any], Callable[[], dict]]:
        """What a checkpoint holds (rank 0 the plain parts, every rank its random state and, as the strategy
        names them, its shards), and the manifest's ``meta``, which the launcher checks a resume by: the global
        batch (a resume at another world size keeps it), the fingerprint (it checks that it loaded what was
        saved) and the strategy's (ddp: the parameter shapes)."""
        state = {"rng": PerRank(RngState()),
                 **self.strategy.checkpoint_parts(self.module, self.optimizer, self._run_state)}
        return state, lambda: {**self.strategy.checkpoint_meta(self.module), "global_batch": self.effective_batch,
                               "fingerprint": self._fingerprint()}

    def _check_finite(self, step: int) -> None:
        """Before a checkpoint: a step since the last check had a non-finite loss or gradient norm: nothing is
        written (``NonFiniteError``), and the run ends."""
        self.finite.check(step, "the checkpoints written before it are kept")

    def save_checkpoint(self) -> Path | None:
        """Write ``checkpoints/step_<step>`` now (async: staged now, on disk in the background). Call on all ranks.

        Raises:
            NonFiniteError: a step since the last check had a non-finite loss or gradient norm: nothing is written.
        """
        return self.run.save()

    # ----------------------------------------------------------------- the loop
    def fit(self) -> dict[str, Any]:
        """Train until ``config.steps``; validate, log and checkpoint along the way. Call on all ranks."""
        if not self._is_setup:
            self.setup()
        cfg = self.config
        self.model.train()  # every submodule; train_step() calls it again only when the root was put in eval mode
        # an exception or Ctrl-C leaves the trackers closed as failed (W&B: not a run "running" forever)
        with self.trackers.closed_on_error():
            for number in self.run.steps(cfg.steps, timed=False):  # train_step times the part that counts
                self.train_step()  # accumulation, backward (DDP all-reduces), clip, optimizer step
                self.step = step = number + 1  # done: a failure from here on is after this step
                if self.first_step_at is None:
                    self.first_step_at = time.time()
                last = step == cfg.steps
                if self.val_data is not None and (last or _due(step, cfg.eval_every)):
                    self.last_val_loss = self.evaluate()
                    self.meter.point(val_loss=self.last_val_loss)  # a log point, with it
                if last:
                    self.meter.point()  # the last step is logged whatever log_every says
                # the run does the rest after each step: the log point (the figures reduced across ranks; rank 0
                # writes metrics.jsonl, prints the line, feeds the trackers: _logged), callbacks, a signal's
                # agreement, the checkpoint
        return {"step": self.step, "val_loss": self.last_val_loss, "interrupted": self.interrupted,
                "signal": self.interrupt_signal}

    def train_step(self) -> dict[str, Any]:
        """One optimizer step: ``accum`` micro-steps, then clip and update. Returns this rank's figures."""
        if not self.module.training:  # after evaluate() or a callback's eval(); train() walks every submodule
            self.model.train()
        loss_sum = torch.zeros((), device=self.env.device)
        with self.meter.step() as counted:
            for micro in range(self.accum):
                batch, self.sampler_state = next(self.batches)
                counted.items += count_items(batch, self.unit)
                # grads are synced in the last micro-step's backward (DDP's all-reduce, FSDP's reduce-scatter); the
                # others skip it, the forward included (DDP prepares its reducer there)
                with self.strategy.no_backward_sync(micro < self.accum - 1), \
                        autocast(self.autocast_precision, self.env.device.type):
                    loss = self.loss_fn(self.model, batch) / self.accum
                self.scaler.scale(loss).backward()
                loss_sum += loss.detach().float()
            grad_norm = self._clip_gradients()
            lr = self.optimizer.param_groups[0]["lr"]
            self.meter.add(loss=loss_sum)  # its mean over the steps since the last log point, on the device until then
            self.meter.extras.update(grad_norm=grad_norm, lr=lr)  # the log point's own step's
            if self._skips(grad_norm):  # nonfinite=skip: the norm is global, so every rank skips the same step
                self.skipped_steps += 1
            else:
                self.finite.update(self.step + 1, loss_sum, grad_norm)  # on the device: no sync
                self.scaler.step(self.optimizer)
                self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            if self.scheduler is not None:
                self.scheduler.step()
            self.strategy.record_comm(self.meter, self.accum)  # DDP's timed all-reduces; FSDP's: not measured
        return {"loss": loss_sum, "grad_norm": grad_norm, "lr": lr}

    def _skips(self, grad_norm: torch.Tensor) -> bool:
        """Whether to skip this optimizer step (``nonfinite=skip`` and a non-finite norm; one host sync)."""
        if self.config.nonfinite != "skip" or self.scaler.is_enabled():  # fp16: the grad scaler skips on its own
            return False
        if bool(torch.isfinite(grad_norm)):
            return False
        if mg.is_main():
            print(f"step {self.step + 1}: gradient norm {float(grad_norm):g}: optimizer step skipped (nonfinite=skip)",
                  flush=True)
        return True

    def _clip_gradients(self) -> torch.Tensor:
        """Unscale (fp16) and clip to ``grad_clip`` (the strategy's clip); returns the norm of the whole gradient."""
        self.scaler.unscale_(self.optimizer)
        return self.strategy.clip_gradients(self.module, self.config.grad_clip if self.config.grad_clip > 0 else
                                            float("inf"))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation windows, split over ranks and reduced. Call on all ranks."""
        if self.val_data is None:
            raise ConfigError("evaluate() needs val_data; pass Trainer(..., val_data=...)")
        self.module.eval()  # the plain module: no DDP collectives, so ranks may run uneven batch counts
        n = min(len(self.val_data), self.config.eval_batches * self.batch_size * self.world_size)
        picks = [int(i * len(self.val_data) / n) for i in range(n)]  # evenly spread over the val set
        mine = list(mg.shard(picks))
        total = torch.zeros(2, dtype=torch.float64)
        # this rank's batches (sharded: every forward all-gathers, so every rank runs as many; the extra ones None)
        for start in self.strategy.eval_batches(list(range(0, len(mine), self.batch_size))):
            if start is None:
                with autocast(self.autocast_precision, self.env.device.type):
                    self.loss_fn(self.module, to_device(self._collate([self.val_data[picks[0]]]), self.env.device))
                continue
            chunk = [self.val_data[i] for i in mine[start : start + self.batch_size]]
            batch = to_device(self._collate(chunk), self.env.device)
            with autocast(self.autocast_precision, self.env.device.type):
                loss = self.loss_fn(self.module, batch)
            total += torch.tensor([loss.item() * len(chunk), len(chunk)], dtype=torch.float64)
        mg.all_reduce(total, "sum", check_shapes=False)
        return (total[0] / total[1]).item()

    def close(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Stop the data stream and write the run summary (rank 0). Call on all ranks. Returns the summary."""
        self.batches.close()
        peaks = mg.gather([_peak_memory(self.env.device)], dst=0)  # one entry per rank
        if mg.is_main():
            kind = "max_memory_allocated" if self.env.device.type == "cuda" else "peak RSS"
            print(f"peak memory per rank ({kind}): " + ", ".join(_mib(b) for b in peaks), flush=True)
        fixed = {"effective_batch": self.effective_batch, "val_loss": self.last_val_loss, "final_step": self.step,
                 "first_step_at": self.first_step_at, **self.strategy.summary(), "peak_memory_bytes": peaks,
                 **(extra or {})}
        summary = self.run.close(lambda summary: {**fixed, **self._utilization(summary["throughput"])})
        # the trackers get the summary, then finish; a run stopped by a signal ends as the process does (130, 143)
        self.trackers.close(summary, exit_code=128 + self.interrupt_signal if self.interrupted else 0)
        return summary

    def _utilization(self, items_per_s: float) -> dict[str, Any]:
        """FLOPs per token and MFU (None where the device's peak is unknown: pass ``peak_tflops``)."""
        if self.unit != "tokens":
            return {}
        from multigpu.train.mfu import flops_per_token, peak_flops

        per_token = flops_per_token(self.module, self.items_per_sample)
        peak = peak_flops(self.env.device, self.config.precision, self.config.peak_tflops)
        mfu = items_per_s * per_token / (peak * self.world_size) if peak else None
        return {"flops_per_token": per_token, "peak_flops": peak, "mfu": mfu}

    # ----------------------------------------------------------------- helpers
    def _collate(self, samples: list) -> Any:
        from torch.utils.data import default_collate

        return (self.collate_fn or default_collate)(samples)

    def _items_per_sample(self) -> int:
        """Tokens (or 1 sample) of one sample, for the plan printed at start and the MFU's context length."""
        return count_items(self._collate([self.train_data[0]]), self.unit)



def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _peak_memory(device: torch.device) -> int:
    """Peak bytes of this rank: allocated on its GPU, or the process's peak resident set on CPU ranks."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _due(step: int, every: int) -> bool:
    return every > 0 and step % every == 0


def _plain(cfg: TrainConfig) -> dict:
    from multigpu.config import to_dict

    return to_dict(cfg)
