"""pytorch/examples' DDP tutorial (ddp-tutorial-series/multigpu_torchrun.py), as a user moves it over: its own
``init_process_group``, a ``DistributedSampler``, a ``Trainer`` class, a snapshot on rank 0 every ``save_every``
epochs, ``destroy_process_group`` at the end.

    multigpu launch --nproc-per-node 2 ddp_tutorial.py 5 2 [--variant V] [--snapshot PATH]

``--variant`` is the step of the move it stands for:
  * ``both`` (default): ``init_process_group("gloo")`` kept, then ``mg.init()`` added, devices from ``mg.device()``
    (the shape ``multigpu bench`` hung on once every epoch was done);
  * ``device-only``: ``init_process_group("gloo")`` kept, only the device lines changed to ``mg.device()``;
  * ``mg-init``: ``init_process_group(...)`` replaced by ``mg.init()``;
  * ``nccl``: the tutorial's own ``init_process_group(backend="nccl")`` (fails on CPU ranks, with a hint).
Each rank prints one JSON line at the end: its rank, the world size, the samples it saw, its final weights.
"""
import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import multigpu as mg


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return index, *self.data[index]


def ddp_setup(variant):
    if variant == "mg-init":
        mg.init()
    elif variant == "nccl":
        init_process_group(backend="nccl")
    else:
        init_process_group(backend="gloo")
        if variant == "both":
            mg.init()


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.device = mg.device()
        self.global_rank = int(os.environ["RANK"])
        self.model = DDP(model.to(self.device))
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.seen = []

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(source), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        for index, source, targets in self.train_data:
            if epoch == 0:
                self.seen += index.tolist()
            self._run_batch(source.to(self.device), targets.to(self.device))

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and self.snapshot_path and epoch % self.save_every == 0:
                torch.save({"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}, self.snapshot_path)


def main(total_epochs, save_every, batch_size, variant, snapshot_path):
    ddp_setup(variant)
    torch.manual_seed(0)
    dataset = MyTrainDataset(64)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    # one write per line: the ranks share the console
    sys.stdout.write(json.dumps({"rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"]),
                                 "seen": trainer.seen,
                                 "weight": trainer.model.module.weight.detach().flatten().tolist()}) + "\n")
    sys.stdout.flush()
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", default=8, type=int)
    parser.add_argument("--variant", default="both", choices=["both", "device-only", "mg-init", "nccl"])
    parser.add_argument("--snapshot", default=None)
    args = parser.parse_args()
    main(args.total_epochs, args.save_every, args.batch_size, args.variant, args.snapshot)
