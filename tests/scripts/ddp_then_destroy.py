"""A plain torch script: joins with torch.distributed itself, trains DDP a step, destroys its group, then writes
the gloo threads still running in this rank to <folder>/threads<rank> (the shutdown test).

With a second argument ``atexit``: the collector is off (as if it had not run yet: the DDP model's reference cycle
still holds the group) and the threads are listed at the interpreter's exit, after the script has ended. With
``never``: the same, and the script never destroys its group (as accelerate's and many plain scripts do not)."""
import atexit
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def step() -> None:
    model = DDP(torch.nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()


def write_threads() -> None:
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    Path(sys.argv[1], f"threads{os.environ['RANK']}").write_text(",".join(sorted(n for n in names if "gloo" in n)))


at_exit = sys.argv[2:] in (["atexit"], ["never"])
if at_exit:
    gc.disable()
dist.init_process_group("gloo")
step()
if sys.argv[2:] != ["never"]:
    dist.destroy_process_group()
if at_exit:
    atexit.register(write_threads)
else:
    write_threads()
