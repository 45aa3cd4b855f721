"""Every rank joins, all-reduces once and prints the sum and its collective timeout (``mg.group.timeout_s()``)."""
import torch

import multigpu as mg
from multigpu.runtime import group

mg.init()
print(f"rank {mg.rank()}: sum {mg.all_reduce(torch.ones(1)).item():g}, timeout {group.timeout_s():g} s", flush=True)
mg.shutdown()
