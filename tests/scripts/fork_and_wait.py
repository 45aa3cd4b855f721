"""Each rank starts two long-lived processes, a plain child and one in a session of its own (as a daemon
would), records their pids as child<R> and daemon<R> and its own as pid<R>, and sleeps until stopped (the
SIGKILLed-launcher orphan test)."""
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
with open(os.path.join(sys.argv[1], f"pid{rank}"), "w") as fh:
    fh.write(str(os.getpid()))
time.sleep(600)
