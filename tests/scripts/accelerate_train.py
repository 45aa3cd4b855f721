"""A plain accelerate training script (as its docs write one): prints what each rank saw, as JSON lines."""
import json
import os
import sys

import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.arange(32, dtype=torch.float32).view(8, 4), torch.ones(8, 1))
loader = torch.utils.data.DataLoader(data, batch_size=2)
model, opt, loader = accelerator.prepare(model, opt, loader)
seen = []
for x, y in loader:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    seen += x[:, 0].int().tolist()
ranks = accelerator.gather(torch.tensor([accelerator.process_index])).tolist()
weights = accelerator.gather(accelerator.unwrap_model(model).weight.detach().view(1, -1)).tolist()
# one write per line: the ranks share the console, and print()'s text and newline are two writes under python -u
sys.stdout.write(json.dumps({"rank": int(os.environ["RANK"]), "num_processes": accelerator.num_processes,
                  "distributed_type": str(accelerator.distributed_type), "ranks": ranks, "seen": seen,
                  "weights_equal": all(w == weights[0] for w in weights),
                  "mixed_precision": accelerator.mixed_precision}) + "\n")
sys.stdout.flush()
