"""Optimizer and learning-rate schedule in nanoGPT's recipe (inside each rank).

``make_optimizer``: AdamW, weight decay on matrices only (not on biases,
LayerNorm weights); the trainer switches it to the fused kernel on GPU ranks (``use_fused``). ``make_scheduler``: linear warm-up, then cosine decay to
``min_lr`` over ``lr_decay_steps``, flat afterwards.
"""

from __future__ import annotations

import math

import torch

from multigpu.train.config import TrainConfig

__all__ = ["make_optimizer", "make_scheduler", "lr_at", "use_fused"]


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over ``model``'s parameters with nanoGPT's decay groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def use_fused(optimizer: torch.optim.Optimizer) -> bool:
    """Switch an Adam/AdamW whose parameters all live on GPUs to its fused kernel (one kernel for every parameter,
    as nanoGPT's loop builds it), as ``fused=True`` at construction would; returns whether it did.

    Left alone: another optimizer, one that has stepped, one whose ``fused``/``foreach`` the user chose, and one
    with a parameter off the GPU (CPU ranks, FSDP's CPU offload). The model is placed after the optimizer is
    built (``Trainer.setup``), which is why this is decided then."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW) or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(g.get("fused") is not None or g.get("foreach") is not None or g.get("differentiable") for g in groups):
        return False
    params = [p for g in groups for p in g["params"]]
    if not params or any(p.device.type != "cuda" or not p.is_floating_point() for p in params):
        return False
    for group in groups:
        group["fused"] = True
    optimizer.defaults["fused"] = True
    optimizer._step_supports_amp_scaling = True  # GradScaler hands the kernel its inf check: no host sync per step
    return True


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The schedule's multiplier of the peak learning rate at optimizer step ``step`` (0-based)."""
    decay_steps = cfg.lr_decay_steps or cfg.steps
    floor = cfg.min_lr / cfg.lr
    if step < cfg.warmup_steps:
        return (step + 1) / (cfg.warmup_steps + 1)
    if step >= decay_steps:
        return floor
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
    return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (1.0 - floor)


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """Warm-up + cosine, stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, cfg))
