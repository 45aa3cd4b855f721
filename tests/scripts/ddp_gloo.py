"""A DDP step on gloo, the least a CPU rank of a training job does: torch, a gloo group, DDP's reducer (the
address-space limit test: it needs about 785 MiB of address space here)."""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import multigpu as mg

mg.init()
model = DDP(torch.nn.Linear(64, 64))
model(torch.ones(8, 64)).sum().backward()
mg.barrier()
print(f"rank {mg.rank()} stepped", flush=True)
mg.shutdown()
