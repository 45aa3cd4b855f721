"""Rank 1 raises after init; rank 0 waits in a barrier (the launcher must report rank 1)."""
import multigpu as mg

env = mg.init()
if env.rank == 1:
    raise ValueError("simulated failure on rank 1")
mg.barrier()
