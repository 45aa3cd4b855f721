"""The end of a plain DDP script, with the race that hung ``multigpu bench`` made certain.

The DDP tutorial ends with ``destroy_process_group()`` and then drops its DDP model (``main()`` returns), so the
model's reducer holds the group's last reference and frees it on the main thread with the interpreter lock held,
joining gloo's threads. If one of them is still freeing the last allreduce of a backward pass (whose work holds a
copy of the thread-local state with the Python object torch's backward stashes there), it waits for the lock: a
deadlock. In the tutorial that is a matter of timing (one run in four); here every step is placed so that it
happens on every run: the allreduce is issued as DDP's backward issues it, the main thread keeps the lock (a
switch interval of 1000 s: no other thread asks for it in time), and the reducer is the group's last holder.
Prints "rank R done" when the rank got past freeing its model.
"""
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(4, 1))
dist.destroy_process_group()  # as the tutorial does at its end: DDP's reducer still holds the group
group = model.process_group
del model.process_group  # the reducer's reference is now the only one the script holds
sys.setswitchinterval(1000)  # the lock changes hands only where its holder lets it go
if os.environ["RANK"] == "1":
    time.sleep(0.5)  # rank 0's allreduce completes while its main thread spins below, holding the lock
torch._C._stash_obj_in_tls("context", object())  # what torch's backward stashes before DDP's allreduce
work = group.allreduce([torch.ones(1)])  # the work copies that thread-local state; gloo's thread runs it
torch._C._remove_obj_from_tls("context")
del work, group  # gloo's thread holds the work's last reference: it frees it, which needs the lock
start = time.perf_counter()
while time.perf_counter() - start < 2:  # pure Python: the lock stays on this thread
    pass
del model  # the reducer frees the group here, unless something else still holds it
sys.stdout.write(f"rank {os.environ['RANK']} done\n")
