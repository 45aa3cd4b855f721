"""Your own model and data, trained data-parallel with multigpu's Trainer (runs inside each rank).

    multigpu launch --nproc-per-node 2 examples/train_custom.py     # 2 CPU ranks; --gpus all on GPUs
    python examples/train_custom.py                                  # the same code on one process
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import multigpu as mg
from multigpu.train import TrainConfig, Trainer


def make_data(n: int, seed: int) -> TensorDataset:
    """A toy regression: y = x @ w_true + noise (the same data on every rank; the sampler splits it)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=gen)
    y = x @ torch.linspace(-1, 1, 16) + 0.01 * torch.randn(n, generator=gen)
    return TensorDataset(x, y)


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x).squeeze(-1), y)


def main() -> None:
    mg.init(seed=0)  # every rank builds the same initial model from this seed
    cfg = TrainConfig(steps=60, batch_size=32, lr=1e-2, warmup_steps=5, eval_every=20, log_every=20,
                      checkpoint_every=0, grad_clip=1.0, precision="fp32")
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=cfg.steps)
    trainer = Trainer(model, optimizer, make_data(4096, seed=1), config=cfg, val_data=make_data(512, seed=2),
                      scheduler=scheduler, loss_fn=mse, unit="samples",
                      run_dir=mg.run_context().run_dir)  # where `multigpu launch`/`bench` put this run (or None)
    trainer.setup()   # moves the model to this rank's device, wraps it in DDP, prints the effective batch
    trainer.fit()     # grads all-reduced across ranks; metrics reduced; rank 0 logs
    summary = trainer.close()
    if mg.is_main():
        print(f"final val_loss {trainer.last_val_loss:.5f}; {summary['throughput']:,.0f} samples/s "
              f"on {summary['world_size']} rank(s)")
    mg.shutdown()


if __name__ == "__main__":
    main()
