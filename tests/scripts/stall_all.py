"""Every rank takes one step, then all of them stall without any collective (the watchdog test)."""
import time

import multigpu as mg
from multigpu.monitor import StepMeter

mg.init()
meter = StepMeter("items", progress=False)
with meter.step(items=1):
    mg.barrier()
while True:  # a data loader that never returns, on every rank
    time.sleep(0.1)
