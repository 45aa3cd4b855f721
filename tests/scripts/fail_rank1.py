"""Rank 1 raises after init, with an all-reduce of its own still in flight whose future calls back into Python (a
DDP comm hook's shape: what a rank failing mid-step holds); rank 0 waits in a barrier. The launcher must report
rank 1 with its own exit code, 1, at once (not after the collective timeout, not SIGABRT from gloo's thread).

With a folder as its argument, each rank first writes ``rank<R>.txt`` there (a file of the user's script, made
with the user's umask)."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import multigpu as mg

env = mg.init()
if len(sys.argv) > 1:
    (Path(sys.argv[1]) / f"rank{env.rank}.txt").write_text("the script's own output")
if env.rank == 1:
    work = dist.all_reduce(torch.ones(4), async_op=True)  # rank 0 never joins it
    work.get_future().then(lambda fut: fut.value())
    raise ValueError("simulated failure on rank 1")
mg.barrier()
