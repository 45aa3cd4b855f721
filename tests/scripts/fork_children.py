"""Each rank starts two long-lived processes, a plain child and one in a session of its own (as a daemon
would), and records their pids as child<R> and daemon<R> (the orphan tests). Then, after the folder:
``wait``: records its own pid as pid<R> and sleeps until stopped (the SIGKILLed-launcher test); else it exits at
once with the code given (default 0), once every rank has started its two."""
import os
import subprocess
import sys
import time

rank = os.environ["RANK"]
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
for name, new_session in (("child", False), ("daemon", True)):
    proc = subprocess.Popen(sleeper, start_new_session=new_session)
    with open(os.path.join(sys.argv[1], f"{name}{rank}"), "w") as fh:
        fh.write(str(proc.pid))
# every rank has started its two before any ends: a rank that exits first would have the launcher stop the others
# before they started theirs (seen once on CI: 2 of 4 started)
deadline = time.monotonic() + 120
while sum(f.startswith(("child", "daemon")) for f in os.listdir(sys.argv[1])) < 2 * int(os.environ["WORLD_SIZE"]):
    if time.monotonic() > deadline:
        sys.exit("the other ranks did not start their processes within 120 s")
    time.sleep(0.05)
then = sys.argv[2] if len(sys.argv) > 2 else "0"
if then == "wait":
    with open(os.path.join(sys.argv[1], f"pid{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)
sys.exit(int(then))
