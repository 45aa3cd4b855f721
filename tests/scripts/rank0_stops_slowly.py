"""Each rank records its pid and waits for the stop (SIGTERM, as the launcher passes on a scheduler's warning);
rank 0 then takes 4 s to stop, as a rank 0 writing the step's checkpoint does, and records when it is done; the
others exit at once. Exit 143, as a rank that checkpointed at an interrupt does."""
import os
import signal
import sys
import time

import multigpu as mg

env = mg.init()
folder = sys.argv[1]
stop: list[int] = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
with open(os.path.join(folder, f"pid{env.rank}"), "w") as fh:
    fh.write(str(os.getpid()))
while not stop:
    time.sleep(0.05)
if env.rank == 0:
    time.sleep(4)
    with open(os.path.join(folder, "rank0_done"), "w") as fh:
        fh.write(repr(time.time()))
sys.exit(143)
