"""Each rank records its pid as pid<R> and the kind of store its process group met through as store<R>, then meets the others in a barrier every 50 ms until the file
``stop`` appears in the folder (at most 120 s), and exits 0 (the store-attack test: a job that runs while
another user attacks it)."""
import os
import sys
import time

import torch.distributed as dist

import multigpu as mg

folder = sys.argv[1]
env = mg.init()
store = dist.distributed_c10d._get_default_store()
while isinstance(store, dist.PrefixStore):
    store = store.underlying_store
with open(os.path.join(folder, f"store{env.rank}"), "w") as fh:
    fh.write(type(store).__name__)
with open(os.path.join(folder, f"pid{env.rank}"), "w") as fh:
    fh.write(str(os.getpid()))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    mg.barrier()
    # rank 0 decides, so every rank leaves after the same barrier
    stop = mg.broadcast_object(os.path.exists(os.path.join(folder, "stop")) if env.rank == 0 else None)
    if stop:
        break
    time.sleep(0.05)
mg.shutdown()
