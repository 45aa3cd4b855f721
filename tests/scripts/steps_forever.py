"""Each rank records its pid, then runs steps of an all-reduce under mg.Run until something breaks (node-loss
test: the launcher reports the last step each rank finished)."""
import os
import sys
import time

import torch

import multigpu as mg
from multigpu.run import Run

env = mg.init()
with open(os.path.join(sys.argv[1], f"pid{env.rank}"), "w") as fh:
    fh.write(str(os.getpid()))
run = Run(total=10**9, progress=False, checkpoint_last=False)
for _ in run.steps():
    mg.all_reduce(torch.ones(8), check_shapes=False)
    time.sleep(0.05)
