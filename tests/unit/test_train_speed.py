"""Activation checkpointing of the model's repeated blocks: same loss and gradients, less kept.

``checkpoint_blocks`` wraps GPT's ``blocks`` (the largest ModuleList of one class) so that their activations
are recomputed in backward. Recomputation runs the same float operations, so the gradients must be equal bit
for bit to the plain model's (dropout off); a model without repeated blocks is a one-line ConfigError.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from multigpu.errors import ConfigError
from multigpu.train import ModelConfig
from multigpu.train.model import GPT
from multigpu.train.speed import checkpoint_blocks, find_blocks
from multigpu.train.trainer import default_loss


def _grads(model: nn.Module, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = default_loss(model, batch)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_checkpointed_blocks_give_the_plain_models_loss_and_gradients():
    torch.manual_seed(0)
    plain = GPT(ModelConfig(n_layer=3, n_head=2, n_embd=16, block_size=8, dropout=0.0), 20)
    wrapped = copy.deepcopy(plain)
    assert checkpoint_blocks(wrapped) == 3 and len(find_blocks(plain)) == 3
    assert sum(isinstance(m, CheckpointWrapper) for m in wrapped.modules()) == 3
    x = torch.randint(0, 20, (4, 8), generator=torch.Generator().manual_seed(1))
    batch = (x, torch.roll(x, -1, dims=1))
    loss_a, grads_a = _grads(plain, batch)
    loss_b, grads_b = _grads(wrapped, batch)
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b, strict=True))


def test_a_model_without_repeated_blocks_is_one_line():
    with pytest.raises(ConfigError, match="activation_checkpointing=true, but the model has no repeated blocks"):
        checkpoint_blocks(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)))
