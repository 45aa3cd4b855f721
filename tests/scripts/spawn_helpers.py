"""Spawns helper processes that join no process group (a pool of workers), then makes a process group of one on
each rank (``world_size=1``, a file store of its own) and trains in it: under a launcher of N ranks, N copies."""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def helper(index, folder):
    with open(os.path.join(folder, f"helper{index}"), "w") as fh:
        fh.write(str(sum(range(10))))


if __name__ == "__main__":
    folder = sys.argv[1]
    mp.spawn(helper, args=(folder,), nprocs=1)
    store = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{store}/s", world_size=1, rank=0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    dist.destroy_process_group()
    print(f"rank {os.environ['RANK']} helpers: {sorted(os.listdir(folder))}", flush=True)
