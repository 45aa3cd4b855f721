"""Your own model and data for `multigpu train`: two factories, nothing else (imported in every rank).

    multigpu train --model examples.byo_train:regressor model.kwargs.width=64 \
                   --data examples.byo_train:regression_data data.kwargs.n=4096 \
                   --loss examples.byo_train:mse unit=samples steps=60 lr=1e-2 --nproc-per-node 2

A model factory returns an ``nn.Module``; a data factory returns ``(train, val)``
datasets (val may be None); a loss is ``fn(model, batch) -> loss`` (the default
is cross-entropy of ``model(x)`` against ``y``, or the model's own ``loss`` for
Hugging Face style dict batches with ``labels``).
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset


def regressor(width: int = 64) -> nn.Module:
    return nn.Sequential(nn.Linear(16, width), nn.GELU(), nn.Linear(width, 1))


def regression_data(n: int = 4096, seed: int = 1):
    """y = x @ w + noise; the same on every rank (the trainer's sampler gives each rank its share)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    y = (x @ torch.linspace(-1, 1, 16) + 0.01 * torch.randn(n, generator=gen)).unsqueeze(1)
    cut = n * 9 // 10
    return TensorDataset(x[:cut], y[:cut]), TensorDataset(x[cut:], y[cut:])


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)
