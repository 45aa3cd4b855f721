"""Each rank starts two long-lived processes, a plain child and one in a session of its own (as a daemon
would), and records their pids as child<R> and daemon<R> (the orphan tests). Then, after the folder:
``wait``: records its own pid as pid<R> and sleeps until stopped (the SIGKILLed-launcher test); else it exits at
once with the code given (default 0)."""
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
then = sys.argv[2] if len(sys.argv) > 2 else "0"
if then == "wait":
    with open(os.path.join(sys.argv[1], f"pid{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    time.sleep(600)
sys.exit(int(then))
