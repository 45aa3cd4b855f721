"""Every rank does one all-reduce and leaves its group; rank 0 then works on alone for argv[1] seconds (a final
save or evaluation), as many training scripts do, and says when it is done."""

import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
rank = dist.get_rank()
dist.destroy_process_group()
if rank == 0:
    time.sleep(float(sys.argv[1]))
print(f"rank {rank} done ({int(total.item())} ranks summed)", flush=True)
