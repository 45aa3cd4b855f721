"""Speed options of the Trainer: activation checkpointing of repeated blocks, ``torch.compile`` (inside each rank)."""

from __future__ import annotations

import shutil
from collections import Counter

import torch
from torch import nn

from multigpu.errors import ConfigError
from multigpu.runtime.logging import warn_once

__all__ = ["can_compile", "checkpoint_blocks", "compiled", "find_blocks"]


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the children of its largest ``ModuleList`` whose members share one class
    (GPT's ``blocks``, Hugging Face's ``transformer.h`` or ``model.layers``)."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            kinds = Counter(type(m) for m in module)
            if len(kinds) == 1:
                best = list(module)
    return best


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap every block of ``model`` (in place) so its activations are recomputed in backward. Returns the count."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    blocks = {id(b) for b in find_blocks(model)}
    if not blocks:
        raise ConfigError("activation_checkpointing=true, but the model has no repeated blocks (no ModuleList of "
                          "same-type modules); turn it off or give the model its blocks as an nn.ModuleList")
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in blocks)
    return len(blocks)


def can_compile(device: torch.device) -> bool:
    """False (said once) on a CPU without a C++ compiler, where ``torch.compile`` cannot build its kernels."""
    if device.type == "cpu" and not any(shutil.which(c) for c in ("c++", "g++", "clang++", "cc")):
        warn_once("compile=true needs a C++ compiler on CPU ranks (none found): running the model eagerly")
        return False
    return True


def compiled(model: nn.Module, device: torch.device) -> nn.Module:
    """``torch.compile(model)``; on a CPU without a C++ compiler, the model as it is (said once)."""
    return torch.compile(model) if can_compile(device) else model
