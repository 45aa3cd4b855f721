"""Each rank prints one line, then waits until the file argv[1] exists (at most 60 s): a job whose output is
read while it runs."""
import os
import sys
import time

import multigpu as mg

env = mg.init()
print(f"hello from rank {env.rank}")
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
