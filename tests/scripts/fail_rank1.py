"""Rank 1 raises after init; rank 0 waits in a barrier (the launcher must report rank 1).

With a folder as its argument, each rank first writes ``rank<R>.txt`` there (a file of the user's script, made
with the user's umask)."""
import sys
from pathlib import Path

import multigpu as mg

env = mg.init()
if len(sys.argv) > 1:
    (Path(sys.argv[1]) / f"rank{env.rank}.txt").write_text("the script's own output")
if env.rank == 1:
    raise ValueError("simulated failure on rank 1")
mg.barrier()
