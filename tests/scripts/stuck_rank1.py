"""Rank 1 never reaches the barrier; rank 0's barrier must time out naming rank 1."""
import time

import multigpu as mg

env = mg.init()
if env.rank == 1:
    time.sleep(120)
mg.barrier()
