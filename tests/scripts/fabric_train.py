"""A Lightning Fabric training script as its docs write one: ``Fabric()`` with its defaults (``devices="auto"``),
``fabric.launch()``, ``setup``/``setup_dataloaders`` (which adds a DistributedSampler). Prints, per rank, one JSON
line: its rank, the world size Fabric saw, the samples it trained on, whether the weights agree across ranks.

    multigpu launch --nproc-per-node 2 fabric_train.py [--devices N]
"""
import argparse
import json
import sys

import torch

try:
    from lightning.fabric import Fabric
except ImportError:  # the standalone package (the dev extra): the same class
    from lightning_fabric import Fabric

parser = argparse.ArgumentParser()
parser.add_argument("--devices", default="auto")
args = parser.parse_args()
fabric = Fabric(devices=args.devices if args.devices == "auto" else int(args.devices))
fabric.launch()
fabric.seed_everything(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
data = torch.utils.data.TensorDataset(torch.arange(8), torch.arange(32, dtype=torch.float32).view(8, 4), torch.ones(8, 1))
loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=2))
seen = []
for index, x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    seen += index.tolist()
weights = fabric.all_gather(model.weight.detach().flatten())
sys.stdout.write(json.dumps({"rank": fabric.global_rank, "world_size": fabric.world_size, "seen": seen,
                             "weights_equal": bool((weights == weights[0]).all())}) + "\n")
sys.stdout.flush()
