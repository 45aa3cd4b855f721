"""The ``train`` workload: your model and data trained data-parallel (``check`` in the launcher, ``main`` in each rank).

    multigpu train -f nano --nproc-per-node 2                 # the default: a character-level GPT on the stdlib
    multigpu train --gpus all --precision bf16 --grad-accum 4 --compile
    multigpu train --model mypkg.nets:make model.kwargs.width=512 --data mypkg.data:load data.kwargs.root=/data
    multigpu train --data multigpu.train.data:token_files data.kwargs.path=shakespeare/   # nanoGPT's train.bin
    multigpu train --model multigpu.train.hf:causal_lm model.kwargs.config=gpt2 model.kwargs.n_layer=2
    multigpu train --resume auto steps=400                    # continue the newest run, longer
    multigpu train --strategy hsdp --nnodes 2 ...              # sharded within each node, replicated across nodes
    multigpu train --logger wandb wandb.project=mine          # W&B on rank 0 beside metrics.jsonl (multigpu[tracking])

``check`` validates everything that needs the job's shape before a rank is
spawned or a file written: the batch split over the world size, the precision
on the job's devices, the sync backend, the factories (they import, take the
given arguments, and pass their own ``check``), the resume file (size and
checksum only: nothing is unpickled in the launcher). ``main`` builds the data
and the model from their factories, trains with :class:`~multigpu.train.Trainer`,
and on rank 0 samples some text when the model can generate and the data can
decode (``sample.txt`` beside ``metrics.jsonl``, ``summary.json`` and
``checkpoints/``), and exports the weights when asked. Importing a factory's
module runs its code, as ``python -m`` would.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from multigpu.argtypes import non_negative_int, positive_int
from multigpu.errors import ConfigError
from multigpu.factory import Factory
from multigpu.jobs.workload import Flag, JobPlan, Workload
from multigpu.runtime.context import RunContext
from multigpu.train.config import TrainConfig, shard_size

__all__ = ["DEFAULT_DATA", "DEFAULT_MODEL", "WORKLOAD", "TrainJobConfig", "build", "check", "export", "export_state",
           "full_state", "main", "sample", "shard_size"]

DEFAULT_MODEL = "multigpu.train.nano:gpt"
"""nanoGPT's GPT (:func:`multigpu.train.nano.gpt`)."""
DEFAULT_DATA = "multigpu.train.data:stdlib_text"
"""Character-level text of the Python standard library (:func:`multigpu.train.data.stdlib_text`)."""

_PRECISIONS = ["fp32", "bf16", "fp16"]


def _check_resume_path(resume: str) -> None:
    """``--resume PATH`` must name an intact checkpoint folder (sizes and SHA-256 as its manifest records)."""
    from multigpu.checkpoint import CorruptCheckpointError, check_resume_path

    try:
        check_resume_path(resume)
    except CorruptCheckpointError as exc:
        raise ConfigError(f"--resume {resume}: {exc.reason}; valid: an intact checkpoint, or auto "
                          "(the newest valid one)") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainJobConfig(TrainConfig):
    """The trainer's knobs plus what to train: the model, the data, the loss, and what to do at the end."""

    model: Factory = field(default_factory=lambda: Factory(factory=DEFAULT_MODEL))
    """A model factory (``model.factory``, ``model.kwargs``) returning an ``nn.Module``."""
    data: Factory = field(default_factory=lambda: Factory(factory=DEFAULT_DATA))
    """A data factory returning ``(train_dataset, val_dataset | None)`` (or one dataset)."""
    loss: str | None = None
    """``pkg.module:fn`` with ``fn(model, batch) -> loss``; None: the trainer's default (cross-entropy, or the
    model's own ``loss`` for Hugging Face style dict batches with labels)."""
    block_size: int | None = 128
    """Context length in tokens, given to the model and data factories that take a ``block_size`` argument."""
    unit: Literal["tokens", "samples"] = "tokens"
    """What throughput counts: the batches' real tokens, or samples."""
    export: Literal["none", "safetensors"] = "none"
    """At the end, rank 0 writes the trained weights to ``model.safetensors`` in the run directory."""
    sample_chars: int = 300
    """Tokens generated at the end when the model can ``generate`` and the data can ``decode`` (0: none)."""
    sample_prompt: str = "def "
    """The text the sample continues."""

    def __post_init__(self) -> None:
        TrainConfig.__post_init__(self)  # zero-argument super() does not work in a slots dataclass
        if self.sample_chars < 0:
            raise ConfigError(f"sample_chars={self.sample_chars} must be >= 0")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"block_size={self.block_size} must be >= 1 (or null)")


def _context(cfg: TrainJobConfig, vocab_size: int | None = None) -> dict:
    return {"block_size": cfg.block_size, "vocab_size": vocab_size}


def _planned_context(cfg: TrainJobConfig) -> dict:
    """The factory context the ranks will use, as far as the launcher knows it: the default data's vocabulary
    (a model factory such as ``causal_lm`` takes it from the data; other data factories: unknown)."""
    if cfg.data.factory != DEFAULT_DATA:
        return _context(cfg)
    from multigpu.train.data import VOCAB

    return _context(cfg, len(VOCAB))


def check(cfg: TrainJobConfig, plan: JobPlan) -> TrainJobConfig | None:
    """Every check that needs the job's shape (in the launcher). Raises ConfigError/DeviceError.

    Returns the config to run when the check changed it (a resume at another world size keeps its global batch
    through the accumulation), else None."""
    from multigpu.factory import import_object
    from multigpu.train.strategy_checks import check_sync_backend
    from multigpu.train.trackers import check_trackers

    cfg.validate_for(plan.world_size)
    for device_type in plan.device_types:
        check_sync_backend(cfg.sync_backend, device_type)
        _check_precision(cfg, plan, device_type)
    cfg.model.check("model.factory", _context(cfg))
    cfg.data.check("data.factory", _context(cfg))
    if cfg.loss:
        import_object(cfg.loss, what="loss", callable_only=True)
    check_trackers(cfg.logger)  # logger: wandb without wandb installed: one line, before anything spawns
    if cfg.export == "safetensors":
        import_object("safetensors.torch:save_model", what="export=safetensors (pip install safetensors)")
    if cfg.strategy != "ddp":  # fsdp, hsdp
        _check_fsdp(cfg, plan)
    if plan.ctx.resume not in (None, "auto"):
        _check_resume_path(plan.ctx.resume)
    _check_resume_fits(cfg, plan)
    kept = _keep_global_batch(cfg, plan)
    _check_memory(kept or cfg, plan)
    if cfg.init_from:
        _check_init_from(cfg)
    return kept


_BATCH_KEYS = ("batch_size", "grad_accum", "grad_accum_scope", "global_batch_size")
"""What the global batch is made of: a resumed run keeps the saved run's, unless the command gives them."""


def _resume_target(plan: JobPlan) -> Path | None:
    """The checkpoint a resume would start from, as far as the launcher can tell without reading its bytes (the
    rule the ranks decide by, :func:`multigpu.checkpoint.resume.planned`; they verify every byte of it)."""
    from multigpu.checkpoint.resume import planned

    return planned(plan.ctx.resume, plan.ctx.run_dir)


def _keep_global_batch(cfg: TrainJobConfig, plan: JobPlan) -> TrainJobConfig | None:
    """A run resumed at another world size says so in one line and keeps its global batch (samples per optimizer
    step) by changing the gradient accumulation; where no accumulation keeps it, it is refused, unless the command
    gives the batch settings itself (then the global batch changes as asked, and the line says so).

    Returns the config with the accumulation that keeps the global batch, or None (unchanged)."""
    import dataclasses
    import json

    from multigpu.checkpoint import CorruptCheckpointError
    from multigpu.checkpoint.store import read_manifest
    from multigpu.config import from_dict

    path = _resume_target(plan)
    if path is None:
        return None
    try:
        manifest = read_manifest(path)
        saved_world = int(manifest["world_size"])
    except (CorruptCheckpointError, KeyError, TypeError, ValueError):
        return None  # the ranks name what is wrong with it
    written = manifest.get("meta", {}).get("global_batch") if isinstance(manifest.get("meta"), dict) else None
    world = plan.world_size
    if saved_world == world:
        return None
    try:
        data = json.loads((path.parent.parent / "run.json").read_text())
        saved = from_dict(TrainJobConfig, data["config"]) if data.get("workload") == "train" else None
    except (OSError, ValueError, KeyError, TypeError, ConfigError):
        saved = None
    where = f"resuming a checkpoint written by {saved_world} rank(s) on {world} rank(s)"
    # the checkpoint's own record of its global batch; the run's config where it has none (written before it did)
    before = written if isinstance(written, int) and written > 0 else \
        saved.effective_batch(saved_world) if saved is not None else None
    now = cfg.effective_batch(world)
    if before is None:  # the saved run's batch is unknown: say what is known
        print(f"multigpu train: {where}; the global batch is {now} samples per step here", flush=True)
        return None
    given = [k for k in _BATCH_KEYS if saved is not None and getattr(cfg, k) != getattr(saved, k)]
    if before == now:
        print(f"multigpu train: {where}: the global batch stays {now} samples per step", flush=True)
        return None
    if given:
        print(f"multigpu train: {where}: the global batch changes from {before} to {now} samples per step, as "
              f"asked ({', '.join(given)} given here)", flush=True)
        return None
    per_rank = cfg.batch_per_rank(world)
    accum, rest = divmod(before, per_rank * world)
    if rest or accum < 1:
        raise ConfigError(
            f"--resume: the checkpoint was written by {saved_world} rank(s) with a global batch of {before} samples "
            f"per step, which {world} rank(s) of batch {per_rank} cannot keep ({before} is not a multiple of "
            f"{per_rank} × {world}); valid: a world size whose ranks split it (--nproc-per-node/--nnodes), or "
            "give batch_size, grad_accum or global_batch_size to change the global batch on purpose")
    total = accum * world if cfg.grad_accum_scope == "global" else accum
    kept = dataclasses.replace(cfg, grad_accum=total)
    print(f"multigpu train: {where}: grad_accum {cfg.grad_accum} -> {total} keeps the global batch of {before} "
          f"samples per step (batch {per_rank} × grad_accum {accum} × {world} rank(s)); give batch_size, grad_accum "
          "or global_batch_size to change it", flush=True)
    return kept


def _check_init_from(cfg: TrainJobConfig) -> None:
    """``init_from`` holds a tensor of the right shape for every parameter of the model (headers only; the model
    on meta). Shapes only with the default data (another data factory may set the vocabulary: the ranks check
    them before reading); where the factory cannot build on meta, only the file itself is checked."""
    from multigpu.train.meta import build_on_meta
    from multigpu.train.pretrained import check_weights, weight_files

    try:
        model = build_on_meta(lambda: cfg.model.build("model.factory", _planned_context(cfg)), cfg.model.factory)
    except ConfigError:
        weight_files(cfg.init_from)
        return
    check_weights(cfg.init_from, model, shapes=cfg.data.factory == DEFAULT_DATA)


def _check_memory(cfg: TrainJobConfig, plan: JobPlan) -> None:
    """The planned training state of one rank (parameters, gradients, Adam; 1/N of it under fsdp, 1/shard_size
    under hsdp) must fit in what a rank of this node may fill: its GPU, or its share of the host memory the job
    may use (the cgroup's limit where a scheduler set one). The model is built on meta; one that cannot be (under
    ddp) is not checked."""
    import torch

    from multigpu.train.meta import build_on_meta
    from multigpu.train.strategy_checks import check_fits

    budgets = [(t, b) for t in plan.device_types if (b := plan.devices.memory_per_rank(t)) is not None]
    if not budgets:
        return
    try:
        model = build_on_meta(lambda: cfg.model.build("model.factory", _planned_context(cfg)), cfg.model.factory)
    except ConfigError:
        return
    if not isinstance(model, torch.nn.Module):
        return
    from multigpu.launch.devices import RANK_RESIDENT_BYTES
    from multigpu.units import format_bytes
    n = plan.devices.nproc_per_node
    host = f"{format_bytes(plan.devices.available_bytes or 0)} available"
    if plan.devices.memory_source:  # a cgroup's limit (a container, SLURM, Kubernetes): launch/memlimit.py
        host += f" under {plan.devices.memory_source}"
    host += f" ÷ {n} rank{'s' if n > 1 else ''} on this node, less {format_bytes(RANK_RESIDENT_BYTES)} each"
    for device_type, budget in budgets:
        if device_type == "cuda" and cfg.fsdp_cpu_offload:
            continue  # the sharded state lives in host memory (it is checked against the host's share, if any)
        check_fits(model, plan.world_size, cfg.strategy, budget, "the smallest selected GPU" if device_type == "cuda" else host,
                   shard_size(cfg, plan))


def _check_precision(cfg: TrainJobConfig, plan: JobPlan, device_type: str) -> None:
    """Precision and dtype on ``device_type``, never initializing CUDA in the launcher (NVML's compute capability;
    without nvidia-ml-py, bf16 on GPUs is left to each rank's check at start, and said so)."""
    import sys

    from multigpu.train.precision import PrecisionSupport, check_precision, cpu_bf16_note, planned_support

    note = cpu_bf16_note(cfg.precision, cfg.dtype, device_type)
    if note:
        print(f"multigpu train: {note}", file=sys.stderr)
    support = planned_support(device_type, plan.devices.gpu_capability)
    if support is None:  # the rest is checked here all the same; bf16 by each rank on its own GPU
        if "bf16" in (cfg.precision, cfg.dtype):
            print("multigpu train: bf16 support of the GPUs is checked by each rank at start (the launcher reads "
                  "it through NVML, never CUDA: pip install 'multigpu[gpu]')", file=sys.stderr)
        support = PrecisionSupport(device_type, bf16=True, fp16_autocast=True, bf16_autocast=True)
    check_precision(cfg.precision, cfg.dtype, support)


def _check_resume_fits(cfg: TrainJobConfig, plan: JobPlan) -> None:
    """The checkpoint a resume would load must hold this model's parameters (shapes from its manifest entry,
    compared with the model built on the meta device: no memory, nothing unpickled). Only where the launcher
    knows the model's shape: the default data (another data factory may set the vocabulary; the ranks then
    check the same before loading). A checkpoint of whole state dicts (ddp's) is refused under fsdp and hsdp."""
    import json

    import torch

    from multigpu.checkpoint import CorruptCheckpointError
    from multigpu.config import to_dict
    from multigpu.train.checkpoint import check_layout, check_resume_fits

    path = _resume_target(plan)
    if path is None:
        return
    try:  # DCP shards (fsdp, hsdp) load into any strategy and layout; whole state dicts (ddp) into ddp only
        sharded = check_layout(path, cfg.strategy)
    except CorruptCheckpointError:
        return  # (auto: the ranks skip it for an intact one; a given path was verified before)
    if sharded or cfg.data.factory != DEFAULT_DATA:
        return  # sharded checkpoints: their shapes are DCP's, checked when loading
    written_by = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        data = json.loads((path.parent.parent / "run.json").read_text())
        written_by = data.get("config") if data.get("workload") == "train" else None
    with torch.device("meta"):
        model = cfg.model.build("model.factory", _context(cfg))
    check_resume_fits(path, model, to_dict(cfg), written_by)


def _check_fsdp(cfg: TrainJobConfig, plan: JobPlan) -> None:
    """The model shards over the job (fsdp) or over each replica (hsdp: ``hsdp_shard_size`` ranks, which must
    divide the world size): it has parameters, the named block classes exist, no rank is left empty.

    The model is built on the ``meta`` device (shapes only, no memory), as the ranks will build it: a factory
    that cannot run there, or a model whose values cannot be made after it (:mod:`multigpu.train.meta`), is
    refused in one line.
    """
    import torch

    from multigpu.train.meta import build_on_meta, check_initializable
    from multigpu.train.strategy_checks import check_hsdp, check_placement, check_sharding

    check_placement(plan.world_size, plan.device_types, cfg.fsdp_cpu_offload, cfg.strategy)
    shards = shard_size(cfg, plan)
    if shards is not None:
        check_hsdp(plan.world_size, shards)
    # the ranks build it on meta too: a factory that cannot is refused before anything spawns
    model = build_on_meta(lambda: cfg.model.build("model.factory", _context(cfg)), cfg.model.factory)
    if isinstance(model, torch.nn.Module):
        check_sharding(model, shards or plan.world_size, cfg.fsdp_blocks, cfg.strategy)
        check_initializable(model)


def _datasets(cfg: TrainJobConfig):
    out = cfg.data.build("data.factory", _context(cfg))
    train, val = out if isinstance(out, tuple) else (out, None)
    if len(train) == 0:
        raise ConfigError(f"data.factory {cfg.data.factory!r} returned an empty training set")
    return train, val


def build(cfg: TrainJobConfig, run_dir: str | Path | None, resume: str | None = None, *,
          ctx: RunContext | None = None):
    """Data, model, loss, optimizer, schedule and trainer (not yet set up). Returns (trainer, model, train_set)."""
    import torch

    import multigpu as mg
    from multigpu.factory import import_object
    from multigpu.train.optim import make_optimizer, make_scheduler
    from multigpu.train.trainer import Trainer, default_loss

    train_set, val_set = _datasets(cfg)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    context = _context(cfg, getattr(train_set, "vocab_size", None))
    # fsdp/hsdp: no memory yet, each rank materializes only its shards (on one rank: all of it, the same values)
    if cfg.strategy != "ddp":
        from multigpu.train.meta import build_on_meta

        model = build_on_meta(lambda: cfg.model.build("model.factory", context), cfg.model.factory)
    else:
        model = cfg.model.build("model.factory", context)
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model.factory {cfg.model.factory!r} returned {type(model).__name__}, not an nn.Module")
    if mg.is_main():
        count = model.num_params() if hasattr(model, "num_params") else sum(p.numel() for p in model.parameters())
        print(f"model: {cfg.model.factory}, {count / 1e6:.2f}M parameters", flush=True)
    loss_fn = import_object(cfg.loss, what="loss", callable_only=True) if cfg.loss else default_loss
    optimizer = make_optimizer(model, cfg)
    trainer = Trainer(model, optimizer, train_set, config=cfg, val_data=val_set, scheduler=make_scheduler(optimizer, cfg),
                      loss_fn=loss_fn, run_dir=run_dir, unit=cfg.unit, resume=resume, ctx=ctx)
    return trainer, model, train_set


def sample(model, data, cfg: TrainJobConfig, device) -> str:
    """``cfg.sample_chars`` tokens after ``cfg.sample_prompt`` (a fixed generator: reproducible), drawn by the model's
    own ``generate``: Hugging Face's, ours (``generator=``), or one with nanoGPT's signature (seeded torch)."""
    import inspect

    import torch

    model.eval()
    prompt = data.encode(cfg.sample_prompt or "\n").long().unsqueeze(0).to(device)
    if getattr(model, "generation_config", None) is not None:  # a Hugging Face model: its own generate()
        torch.manual_seed(cfg.seed)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=cfg.sample_chars,
                             do_sample=True, pad_token_id=0)
    elif "generator" in inspect.signature(model.generate).parameters:  # ours: generate(idx, new_tokens, generator=)
        out = model.generate(prompt, cfg.sample_chars, generator=torch.Generator().manual_seed(cfg.seed))
    else:  # nanoGPT's generate(idx, max_new_tokens, temperature=1.0, top_k=None) draws from torch's generator
        torch.manual_seed(cfg.seed)
        out = model.generate(prompt, cfg.sample_chars)
    return data.decode(out[0].tolist())


def export(model, path: Path, state: dict | None = None) -> Path:
    """The trained weights as safetensors (shared tensors such as tied embeddings stored once). Rank 0 only.

    ``state``: the gathered state of a sharded model (:func:`full_state`); None reads ``model.state_dict()``.
    A Hugging Face model also gets its ``config.json`` (and ``generation_config.json``) beside the weights,
    so the folder is one that ``from_pretrained`` loads.
    """
    export_state(model.state_dict() if state is None else state, path)
    for name in ("config", "generation_config"):  # what from_pretrained reads beside model.safetensors
        part = getattr(model, name, None)
        if part is not None and callable(getattr(part, "save_pretrained", None)):
            part.save_pretrained(str(path.parent))
    return path


def full_state(model) -> dict | None:
    """The whole state dict of a sharded (fsdp, hsdp) model, gathered to rank 0's CPU memory (None elsewhere).

    Call on all ranks. Tied parameters (GPT's embedding and head) are one tensor under each of their
    names, as in the plain model's ``state_dict()``, so the export stores them once.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import multigpu as mg

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not mg.is_main():
        return None
    # a dimension not divisible by the world size is padded by fsdp, and the gathered tensor is a view of that
    # padded storage: safetensors refuses a tied pair that covers no storage whole, so each gets its own
    state = {name: _own_storage(value) for name, value in state.items()}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        state[name] = state[first.setdefault(id(param), name)]
    return state


def _own_storage(tensor):
    """``tensor`` itself when it is the whole of a contiguous storage, else a contiguous copy."""
    import torch

    whole = tensor.numel() * tensor.element_size()
    if tensor.is_contiguous() and tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == whole:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


class _StateOnly:
    """What ``safetensors.torch.save_model`` reads of a model: its ``state_dict()``."""

    def __init__(self, state: dict):
        self._state = state

    def state_dict(self) -> dict:
        return dict(self._state)


def export_state(state: dict, path: Path) -> Path:
    """``state`` (from :func:`full_state`) as one safetensors file that ``load_model`` reads into the plain model."""
    from safetensors.torch import save_model

    from multigpu.files import atomic_path

    with atomic_path(path) as tmp:  # drops the duplicate names of tied tensors, as for a plain model
        save_model(_StateOnly(state), str(tmp), metadata={"format": "pt"})  # the format from_pretrained expects
    return path


def _kept_on_resize(cfg: TrainJobConfig, ctx: RunContext) -> TrainJobConfig:
    """In the ranks of an elastic job (``--nnodes MIN:MAX``) that torch's agent re-formed at another size: the
    launcher's resume check (:func:`_keep_global_batch`), at the size the job has now (rank 0 says it)."""
    import contextlib
    import io
    from types import SimpleNamespace

    import multigpu as mg

    plan = SimpleNamespace(world_size=mg.world_size(), ctx=SimpleNamespace(resume=ctx.resume_from,
                                                                               run_dir=ctx.run_dir))
    with contextlib.nullcontext() if mg.is_main() else contextlib.redirect_stdout(io.StringIO()):
        return _keep_global_batch(cfg, plan) or cfg


def main(cfg: TrainJobConfig, ctx: RunContext) -> int:
    import multigpu as mg

    run_dir = Path(ctx.run_dir) if ctx.run_dir else None
    if ctx.elastic and ctx.resume_from:  # re-formed at another size: keep the global batch, as a resume does
        cfg = _kept_on_resize(cfg, ctx)
    trainer, model, train_set = build(cfg, run_dir, ctx=ctx)
    trainer.setup()
    result = trainer.fit()
    if result["interrupted"]:  # Ctrl-C/SIGTERM with checkpoint_on_interrupt: the checkpoint of this step is written
        trainer.close()
        if mg.is_main():
            again = ctx.resume_command or f"multigpu train --run-dir {run_dir} --resume auto"
            print(f"interrupted after step {trainer.step}: checkpoint {trainer.checkpoints.path_for(trainer.step)}; "
                  f"continue with: {again}", flush=True)
        return 128 + result["signal"]  # as a process ended by that signal: 130 for SIGINT, 143 for SIGTERM
    summary = trainer.close({"params": sum(p.numel() for p in model.parameters())})
    if trainer.last_val_loss is not None:  # what `multigpu verify --nproc 1,2 train` compares across world sizes
        mg.verify.record("val_loss", trainer.last_val_loss)
    sharded = trainer.strategy.sharded  # fsdp: every forward all-gathers, so all ranks sample; the export is gathered
    can_sample = cfg.sample_chars and hasattr(model, "generate") and hasattr(train_set, "decode")
    text = sample(model, train_set, cfg, mg.device()) if can_sample and (sharded or mg.is_main()) else ""
    exporting = cfg.export == "safetensors" and run_dir is not None
    state = full_state(model) if exporting and sharded else None
    if mg.is_main():
        if run_dir is not None and text:
            (run_dir / "sample.txt").write_text(text)
        if exporting:
            out = run_dir / "model.safetensors"
            print(f"exported: {export(model, out, state)}", flush=True)
        val = f"val_loss {trainer.last_val_loss:.4f}, " if trainer.last_val_loss is not None else ""
        mfu = f" (MFU {summary['mfu']:.1%})" if summary.get("mfu") is not None else ""
        print(f"done: step {trainer.step}, {val}{summary.get('throughput', 0.0):,.0f} {cfg.unit}/s{mfu}; "
              f"outputs in {run_dir}" + (f"\n--- sample ---\n{text}\n--------------" if text else ""), flush=True)
    return 0



def _dry_run(cfg, plan, rank: int, report) -> None:
    """``--dry-run``'s part of this workload, as rank ``rank`` would run it (:mod:`multigpu.train.dryrun`)."""
    from multigpu.train.dryrun import examine

    examine(cfg, plan, rank, report)

WORKLOAD = Workload(
    name="train",
    config=TrainJobConfig,
    check=check,
    main=main,
    init=lambda cfg: {"seed": cfg.seed},
    resumable=True,
    resume_total=lambda cfg: cfg.steps,
    preload=("torch._dynamo",),  # its optimizer imports it when made
    dry_run=_dry_run,
    help="data-parallel training of your model and data (default: a character-level GPT) on every selected GPU",
    preset="nano",
    flags=(
        Flag("--sync-backend", "sync_backend", choices=["auto", "nccl", "gloo", "cpu"], help="gradient all-reduce backend"),
        Flag("--precision", "precision", choices=_PRECISIONS, help="autocast precision"),
        Flag("--dtype", "dtype", choices=_PRECISIONS, help="the model's parameter dtype"),
        Flag("--grad-accum", "grad_accum", type=positive_int, metavar="N", help="gradient accumulation steps (see grad_accum_scope)"),
        Flag("--prefetch", "prefetch", type=non_negative_int, metavar="N", help="batches moved to the device ahead of use"),
        Flag("--checkpoint-on-interrupt", "checkpoint_on_interrupt", action="store_true",
             help="on Ctrl-C or SIGTERM, finish the current step and write a checkpoint before stopping"),
        Flag("--checkpoint-mode", "checkpoint_mode", choices=["async", "sync"],
             help="async: write checkpoints in the background while training goes on (the default); sync: wait "
                  "until each is on disk"),
        Flag("--model", "model.factory", metavar="PKG.MODULE:FACTORY",
             help=f"model factory (model.kwargs.NAME=... for its arguments; default {DEFAULT_MODEL})"),
        Flag("--data", "data.factory", metavar="PKG.MODULE:FACTORY",
             help=f"data factory returning (train, val) datasets (data.kwargs.NAME=...; default {DEFAULT_DATA}; "
                  "also multigpu.train.data:token_files, :bytes_file, multigpu.train.hf:saved_dataset)"),
        Flag("--loss", "loss", metavar="PKG.MODULE:FN", help="loss function fn(model, batch) -> loss"),
        Flag("--strategy", "strategy", choices=["ddp", "fsdp", "hsdp"],
             help="ddp: a whole replica per rank; fsdp: parameters, gradients and optimizer state sharded; "
                  "hsdp: sharded within each node (hsdp_shard_size=K ranks), replicated across nodes"),
        Flag("--compile", "compile", action="store_true", help="torch.compile the model"),
        Flag("--logger", "logger", metavar="NAME[,NAME]",
             help="trackers beside metrics.jsonl: tensorboard, wandb (wandb.project=..., wandb.mode=offline)"),
        Flag("--export", "export", choices=["none", "safetensors"], help="write the final weights (model.safetensors)"),
    ),
    bench=("steps=20", "eval_every=0", "checkpoint_every=0", "log_every=0", "sample_chars=0"),
)
