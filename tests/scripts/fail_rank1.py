"""Rank 1 raises after init, with an all-reduce of its own still in flight whose future calls back into Python (a
DDP comm hook's shape: what a rank failing mid-step holds); rank 0 waits in a barrier. The launcher must report
rank 1 with its own exit code, 1, at once (not after the collective timeout, not SIGABRT from gloo's thread)."""
import torch
import torch.distributed as dist

import multigpu as mg

env = mg.init()
if env.rank == 1:
    work = dist.all_reduce(torch.ones(4), async_op=True)  # rank 0 never joins it
    work.get_future().then(lambda fut: fut.value())
    raise ValueError("simulated failure on rank 1")
mg.barrier()
