"""Rank 1 returns early (exit code 0) while rank 0 waits for it in a collective."""
import sys

import torch

import multigpu as mg

env = mg.init()
if env.rank == 1:
    sys.exit(0)
mg.all_reduce(torch.ones(1))
