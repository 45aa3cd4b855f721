"""Each rank records its pid, then sleeps until it is stopped (the Ctrl-C test)."""
import os
import sys
import time

import multigpu as mg

env = mg.init()
with open(os.path.join(sys.argv[1], f"pid{env.rank}"), "w") as fh:
    fh.write(str(os.getpid()))
time.sleep(600)
