"""The ``train`` workload: the nano GPT trained data-parallel (``check`` in the launcher, ``main`` in each rank).

    multigpu train -f nano --nproc-per-node 2                 # 2 CPU ranks where there is no GPU
    multigpu train --gpus all --precision bf16 --grad-accum 4
    multigpu train --resume auto steps=400                    # continue the newest run, longer
    multigpu bench --nproc 1,2 train steps=20                 # the same workload, measured

``check`` validates everything that needs the job's shape before a rank is
spawned or a file written: the batch split over the world size, the precision
on the job's devices, the sync backend, the data path, the resume file (size
and checksum only: nothing is unpickled in the launcher). ``main`` loads the
standard library's source as text, builds the GPT, trains it with
:class:`~multigpu.train.Trainer`, and on rank 0 samples some text at the end
(``sample.txt`` beside ``metrics.jsonl``, ``summary.json`` and ``checkpoints/``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from multigpu.argtypes import non_negative_int, positive_int
from multigpu.errors import ConfigError
from multigpu.jobs.workload import Flag, JobPlan, Workload
from multigpu.runtime.context import RunContext
from multigpu.train.nano import NanoConfig

__all__ = ["WORKLOAD", "build", "check", "main", "sample"]

_PRECISIONS = ["fp32", "bf16", "fp16"]


def _check_resume_file(resume: str) -> None:
    """``--resume PATH`` must name an intact checkpoint (size and SHA-256 as its manifest records)."""
    from multigpu.checkpointing import CorruptCheckpointError
    from multigpu.train.checkpoint import check_checkpoint

    if not Path(resume).is_file():
        raise ConfigError(f"--resume {resume}: no such file; valid: auto, or the path of a checkpoints/ckpt_*.pt")
    try:
        check_checkpoint(resume)
    except CorruptCheckpointError as exc:
        raise ConfigError(f"--resume {resume}: {exc.reason}; valid: an intact checkpoint, or auto "
                          "(the newest valid one)") from None


def check(cfg: NanoConfig, plan: JobPlan) -> None:
    """Every check that needs the job's shape (in the launcher). Raises ConfigError/DeviceError."""
    from multigpu.train.data import find_files
    from multigpu.train.precision import check_precision, probe_support
    from multigpu.train.sync import check_sync_backend

    cfg.validate_for(plan.world_size)
    for device_type in plan.device_types:
        check_sync_backend(cfg.sync_backend, device_type)
        check_precision(cfg.precision, cfg.dtype, probe_support(device_type))
    find_files(cfg.data)
    if plan.run.resume not in (None, "auto"):
        _check_resume_file(plan.run.resume)
    _check_resume_fits(cfg, plan)


def _check_resume_fits(cfg: NanoConfig, plan: JobPlan) -> None:
    """The checkpoint a resume would load must hold this model's parameters (shapes from its manifest entry,
    compared with the model built on the meta device: no memory, nothing unpickled)."""
    import json

    import torch

    from multigpu.checkpointing import CheckpointFolder
    from multigpu.config import to_dict
    from multigpu.train.checkpoint import check_resume_fits
    from multigpu.train.data import VOCAB
    from multigpu.train.model import GPT

    resume = plan.run.resume
    if resume is None or (resume == "auto" and not plan.run.run_dir):
        return
    if resume == "auto":
        folder = CheckpointFolder(Path(plan.run.run_dir) / "checkpoints", warn=lambda _: None)
        entries = [e for e in folder.manifest().values() if isinstance(e.get("file"), str)]
        listed = [folder.directory / e["file"] for e in sorted(entries, key=lambda e: e.get("step", 0))]
        listed = [p for p in listed if p.is_file()]
        if not listed:
            return
        path = listed[-1]
    else:
        path = Path(resume)
    written_by = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        data = json.loads((path.parent.parent / "run.json").read_text())
        written_by = data.get("config") if data.get("workload") == "train" else None
    with torch.device("meta"):
        model = GPT(cfg.model, len(VOCAB))
    check_resume_fits(path, model, to_dict(cfg), written_by)


def build(cfg: NanoConfig, run_dir: str | Path | None, resume: str | None = None):
    """Data, model, optimizer, schedule and trainer for the nano GPT (not yet set up). Returns (trainer, model)."""
    import torch

    import multigpu as mg
    from multigpu.train.data import VOCAB, CharDataset, load_text
    from multigpu.train.model import GPT
    from multigpu.train.optim import make_optimizer, make_scheduler
    from multigpu.train.trainer import Trainer

    text = load_text(cfg.data, min_chars=cfg.model.block_size + 1)
    train_set, val_set = CharDataset(text.train, cfg.model.block_size), CharDataset(text.val, cfg.model.block_size)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = GPT(cfg.model, len(VOCAB))
    if mg.is_main():
        print(f"nano GPT: {model.num_params() / 1e6:.2f}M parameters; data: {text.num_files} files, "
              f"{len(text.train):,} train / {len(text.val):,} validation characters", flush=True)
    optimizer = make_optimizer(model, cfg)
    trainer = Trainer(model, optimizer, train_set, config=cfg, val_data=val_set, scheduler=make_scheduler(optimizer, cfg),
                      run_dir=run_dir, unit="tokens", resume=resume)
    return trainer, model


def sample(model, cfg: NanoConfig, device) -> str:
    """``cfg.sample_chars`` characters after ``cfg.sample_prompt`` (a fixed generator: reproducible)."""
    import torch

    from multigpu.train.data import decode, encode

    model.eval()
    prompt = encode(cfg.sample_prompt or "\n").long().unsqueeze(0).to(device)
    out = model.generate(prompt, cfg.sample_chars, generator=torch.Generator().manual_seed(cfg.seed))
    return decode(out[0].tolist())


def main(cfg: NanoConfig, ctx: RunContext) -> int:
    import multigpu as mg

    run_dir = Path(ctx.run_dir) if ctx.run_dir else None
    trainer, model = build(cfg, run_dir, ctx.resume)
    trainer.setup()
    result = trainer.fit()
    if result["interrupted"]:  # Ctrl-C with checkpoint_on_interrupt: the checkpoint of this step is written
        trainer.close()
        if mg.is_main():
            print(f"interrupted after step {trainer.step}: checkpoint {trainer.checkpoints.path_for(trainer.step)}; "
                  f"continue with: multigpu train --run-dir {run_dir} --resume auto", flush=True)
        return 130
    summary = trainer.close({"params": model.num_params(), "flops_per_token": model.flops_per_token()})
    if mg.is_main():
        text = sample(model, cfg, mg.device()) if cfg.sample_chars else ""
        if run_dir is not None and cfg.sample_chars:
            (run_dir / "sample.txt").write_text(text)
        tput = summary.get("throughput", 0.0)
        val = f"val_loss {trainer.last_val_loss:.4f}, " if trainer.last_val_loss is not None else ""
        print(f"done: step {trainer.step}, {val}{tput:,.0f} tokens/s; outputs in {run_dir}"
              + (f"\n--- sample ---\n{text}\n--------------" if text else ""), flush=True)
    return 0


WORKLOAD = Workload(
    name="train",
    config=NanoConfig,
    check=check,
    main=main,
    init=lambda cfg: {"seed": cfg.seed},
    help="train the built-in character-level GPT on every selected GPU (or CPU ranks)",
    preset="nano",
    flags=(
        Flag("--sync-backend", "sync_backend", choices=["auto", "nccl", "gloo", "cpu"], help="gradient all-reduce backend"),
        Flag("--precision", "precision", choices=_PRECISIONS, help="autocast precision"),
        Flag("--dtype", "dtype", choices=_PRECISIONS, help="the model's parameter dtype"),
        Flag("--grad-accum", "grad_accum", type=positive_int, metavar="N", help="gradient accumulation steps (see grad_accum_scope)"),
        Flag("--prefetch", "prefetch", type=non_negative_int, metavar="N", help="batches moved to the device ahead of use"),
        Flag("--checkpoint-on-interrupt", "checkpoint_on_interrupt", action="store_true",
             help="on Ctrl-C, finish the current step and write a checkpoint before stopping"),
    ),
    bench=("steps=20", "eval_every=0", "checkpoint_every=0", "log_every=0", "sample_chars=0"),
)
