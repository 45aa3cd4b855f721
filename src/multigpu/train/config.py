"""TrainConfig: every knob of data-parallel training (read on both sides of the launch).

The launcher builds it from a YAML file plus overrides and validates it before
anything is spawned; each rank reads the resolved copy. It holds the trainer's
knobs only: what to train (the built-in nano GPT, its data, its samples) is
the workload's own config (:class:`multigpu.train.nano.NanoConfig` extends this one).

Glossary: *step* = one optimizer update; *micro-step* = one forward+backward
of ``batch_size`` samples on one rank; ``grad_accum`` micro-steps make a step.
The *effective batch* is ``batch_size × grad_accum (per rank) × world_size``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from multigpu.errors import ConfigError
from multigpu.train.trackers import TrackerName, WandbConfig

__all__ = ["TrainConfig", "lr_scale_factor", "per_rank_accum", "require", "shard_size"]

Precision = Literal["fp32", "bf16", "fp16"]
SyncBackend = Literal["auto", "nccl", "gloo", "cpu"]


def require(ok: bool, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``: the training configs' checks, one line each."""
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """Data-parallel training; see the module docstring for the words used."""

    steps: int = 200
    """Optimizer steps to run in total (a resumed run continues up to this)."""
    batch_size: int = 16
    """Samples per micro-step on each rank."""
    global_batch_size: int | None = None
    """If set, derive ``batch_size`` = global / (world_size × per-rank grad_accum); must divide evenly."""
    grad_accum: int = 1
    """Micro-steps per optimizer step (see ``grad_accum_scope``)."""
    grad_accum_scope: Literal["global", "per_rank"] = "per_rank"
    """"per_rank": every rank does ``grad_accum`` micro-steps; "global": ``grad_accum`` is the
    job's total, divided by world_size (nanoGPT's way: the effective batch stays the same on any world size)."""

    lr: float = 1e-3
    """Peak learning rate (before any ``lr_scaling``)."""
    min_lr: float = 1e-4
    """Floor of the cosine decay."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    lr_decay_steps: int | None = None
    """Cosine decay length in steps; None = ``steps``."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale ``lr`` by (effective batch / ``ref_batch_size``) or its square root."""
    ref_batch_size: int = 64
    """The effective batch at which ``lr`` was tuned (for ``lr_scaling``)."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping (the norm is still reported)."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: ``stop`` training (at the next log point or checkpoint, naming
    the first such step; no checkpoint of it is written), or ``skip`` that optimizer step (one host sync per
    step on a GPU). See :mod:`multigpu.train.finite`."""

    precision: Precision = "fp32"
    """Autocast precision of forward/backward: fp32 (none), bf16, fp16 (with a grad scaler)."""
    dtype: Precision = "fp32"
    """The model's own parameter dtype."""
    tf32: bool = True
    """Allow TF32 matmuls on CUDA (Ampere and later)."""
    cudnn_benchmark: bool = False
    """cudnn.benchmark: autotune convolutions for fixed shapes."""

    sync_backend: SyncBackend = "auto"
    """Gradient all-reduce: auto (the process group's: nccl on GPUs, gloo on CPU), nccl, gloo,
    or cpu (buckets staged through host memory, all-reduced over a gloo group)."""
    compile: bool = False
    """``torch.compile`` the model (after activation checkpointing and DDP, as DDP's documentation orders; under
    fsdp each block, before sharding); on a CPU without a C++ compiler the trainer says so once and runs eagerly."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them (the model's repeated
    blocks: the largest ModuleList of same-type modules, e.g. GPT's ``blocks``, Hugging Face's ``h``/``layers``)."""
    peak_tflops: float | None = None
    """Peak TFLOP/s of one device, for MFU where the built-in table does not know the device (CPUs)."""
    strategy: Literal["ddp", "fsdp", "hsdp"] = "ddp"
    """ddp: every rank holds the whole model, its gradients and optimizer state (gradients all-reduced);
    fsdp: each rank holds 1/world_size of each (``fully_shard`` per block, then the root; see
    :mod:`multigpu.train.strategies`), for a model whose training state does not fit on one device. On 2 or more
    ranks the whole model is never put on a GPU: it stays on the host and each rank keeps its shards on its
    device. Not in hybrid jobs (GPU and CPU ranks). hsdp: fsdp within groups of ``hsdp_shard_size`` ranks
    (default: a node), replicated across groups."""
    hsdp_shard_size: int | None = None
    """hsdp: ranks that shard one replica (a 2-D ``(replicate, shard)`` mesh: sharded within a group, typically a
    node, replicated across groups, so only the gradient all-reduce between replicas crosses nodes); None: the
    ranks per node (``local_world_size``). Must divide the world size."""
    fsdp_blocks: list[str] = field(default_factory=list)
    """Module class names sharded one by one under fsdp (default: the model's repeated blocks, as for
    ``activation_checkpointing``)."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free each block's gathered parameters after its forward (gathered again in backward)."""
    fsdp_cpu_offload: bool = False
    """fsdp on GPUs, 2 or more ranks: keep sharded parameters, gradients and optimizer state in host memory (the
    optimizer steps on the CPU). Refused at world size 1 (nothing is sharded there) and on CPU ranks."""
    init_from: str | None = None
    """Start from these weights: a safetensors file or a Hugging Face folder (``model.safetensors`` or its sharded
    index). Each rank reads only its own shards' rows under fsdp (:mod:`multigpu.train.pretrained`); a resumed
    run's checkpoint takes precedence."""
    find_unused_parameters: bool = False
    """DDP's find_unused_parameters (only when some parameters get no gradient)."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size."""

    num_workers: int = 0
    """DataLoader worker processes per rank."""
    prefetch: int = 2
    """Batches moved to the device ahead of use by a background thread (0 = none)."""
    pin_memory: bool = True
    """On GPU ranks, copy host batches from page-locked memory (a faster copy, which overlaps compute); tensors
    a dataset returns on a GPU already are never pinned. False: ordinary host memory (where page-locked
    memory is scarce). Not used on CPU ranks."""

    eval_every: int = 50
    """Validate every N steps (and at the end); 0 = only at the end."""
    eval_batches: int = 8
    """Validation batches per evaluation (the same fixed batches every time)."""
    log_every: int = 10
    """Reduce metrics across ranks and log every N steps."""
    checkpoint_every: int = 100
    """Write a checkpoint every N steps (and at the end); 0 = only at the end."""
    keep_last: int = 3
    """Checkpoints to keep (older ones are deleted)."""
    checkpoint_mode: Literal["async", "sync"] = "async"
    """async: a checkpoint is copied to host memory (pinned on GPUs) and written in the background while training
    goes on; sync: every rank waits until it is on disk (use it where the host cannot hold one more copy of each
    rank's model and optimizer state)."""
    checkpoint_on_interrupt: bool = False
    """On Ctrl-C or SIGTERM (from the launcher, ``timeout`` or a scheduler), finish the current step on every
    rank, write a checkpoint, then exit (130 for SIGINT, 143 for SIGTERM); False: stop at once, keeping only
    the periodic checkpoints."""

    logger: list[TrackerName] | None = None
    """Trackers beside the console and ``metrics.jsonl`` (always written): ``tensorboard``, ``wandb``
    (``logger=tensorboard,wandb``; ``[]``: none); rank 0 only. None: TensorBoard when it is installed.
    See :mod:`multigpu.train.trackers`; ``pip install "multigpu[tracking]"`` installs both."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """``logger: wandb``'s run: ``wandb.project`` (multigpu), ``wandb.name`` (the run directory's name),
    ``wandb.entity``, ``wandb.mode`` (online/offline/disabled), ``wandb.dir`` (the run directory), ``wandb.tags``."""

    seed: int = 1337
    callbacks: list[str] = field(default_factory=list)
    """``pkg.module:factory`` names; each factory, called with no arguments, returns an object whose
    ``on_step(event)`` runs on every rank after each optimizer step, before its checkpoint (``event.step``: steps
    done; ``event.state["model"]``, ``event.run``: see :class:`multigpu.run.StepEvent`). Importing the module runs
    its code."""

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "grad_accum", "ref_batch_size", "eval_batches", "keep_last"):
            require(getattr(self, key) >= 1, f"{key}={getattr(self, key)} must be >= 1")
        for key in ("warmup_steps", "eval_every", "log_every", "checkpoint_every", "num_workers", "prefetch"):
            require(getattr(self, key) >= 0, f"{key}={getattr(self, key)} must be >= 0")
        require(self.global_batch_size is None or self.global_batch_size >= 1,
                 f"global_batch_size={self.global_batch_size} must be >= 1")
        require(self.lr > 0 and self.min_lr >= 0, f"lr={self.lr} must be > 0 and min_lr={self.min_lr} >= 0")
        require(self.lr_decay_steps is None or self.lr_decay_steps >= 1,
                 f"lr_decay_steps={self.lr_decay_steps} must be >= 1")
        require(self.grad_clip >= 0, f"grad_clip={self.grad_clip} must be >= 0")
        require(self.bucket_cap_mb > 0, f"bucket_cap_mb={self.bucket_cap_mb} must be > 0")
        require(self.hsdp_shard_size is None or self.hsdp_shard_size >= 1,
                 f"hsdp_shard_size={self.hsdp_shard_size} must be >= 1")
        require(self.strategy == "ddp" or self.precision != "fp16",
                 f"strategy={self.strategy} with precision=fp16: FSDP's mixed precision here is bf16 (parameters in "
                 "bf16, gradients reduced in fp32); valid: precision bf16 or fp32")
        require(self.peak_tflops is None or self.peak_tflops > 0, f"peak_tflops={self.peak_tflops} must be > 0")

    def accum_per_rank(self, world_size: int) -> int:
        """Micro-steps each rank runs per optimizer step; see :func:`per_rank_accum`."""
        return per_rank_accum(self.grad_accum, self.grad_accum_scope, world_size)

    def batch_per_rank(self, world_size: int) -> int:
        """``batch_size``, or the share of ``global_batch_size`` of one micro-step on one rank."""
        if self.global_batch_size is None:
            return self.batch_size
        accum = self.accum_per_rank(world_size)
        split = world_size * accum
        if self.global_batch_size % split:
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} is not divisible by world_size × grad_accum "
                f"= {world_size} × {accum} = {split}; valid: a multiple of {split}"
            )
        return self.global_batch_size // split

    def effective_batch(self, world_size: int) -> int:
        """Samples per optimizer step over the whole job."""
        return self.batch_per_rank(world_size) * self.accum_per_rank(world_size) * world_size

    def validate_for(self, world_size: int) -> None:
        """The checks that need the job's size (run by the launcher before anything starts)."""
        self.effective_batch(world_size)


def per_rank_accum(grad_accum: int, scope: str, world_size: int) -> int:
    """Micro-steps per rank: ``grad_accum`` ("per_rank"), or ``grad_accum / world_size`` ("global").

    Example: grad_accum=8, scope="global" -> 8 on 1 rank, 4 each on 2 ranks, an error on 3.
    """
    if scope == "per_rank":
        return grad_accum
    if grad_accum % world_size:
        raise ConfigError(
            f"grad_accum={grad_accum} is the job's total (grad_accum_scope=global) but is not divisible by "
            f"world_size={world_size}; valid: a multiple of {world_size}, or grad_accum_scope=per_rank"
        )
    return grad_accum // world_size


def lr_scale_factor(mode: str, effective_batch: int, ref_batch: int) -> float:
    """The learning-rate multiplier of ``lr_scaling``: 1, batch/ref, or sqrt(batch/ref)."""
    if mode == "none":
        return 1.0
    ratio = effective_batch / ref_batch
    return ratio if mode == "linear" else math.sqrt(ratio)


def shard_size(cfg: TrainConfig, plan) -> int | None:
    """hsdp: the ranks of one replica (``hsdp_shard_size``, default the ranks per node, as the trainer's
    ``local_world_size``); None under ddp and fsdp."""
    if cfg.strategy != "hsdp":
        return None
    return cfg.hsdp_shard_size or plan.devices.nproc_per_node
