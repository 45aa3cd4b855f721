"""Both ranks print the same number of lines at once (after a barrier), with plain print(): the console test."""
import sys

import multigpu as mg

env = mg.init()
lines = int(sys.argv[1])
mg.barrier()
for i in range(lines):
    print(f"rank{env.rank}-" + "x" * 80 + f"-{i}")
mg.shutdown()
