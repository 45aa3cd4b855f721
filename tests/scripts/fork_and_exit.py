"""Each rank starts two long-lived processes, a plain child and one in a session of its own (as a daemon
would), records their pids as child<R> and daemon<R>, and exits 0 at once (the orphan test)."""
import os
import subprocess
import sys

rank = os.environ["RANK"]
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
for name, new_session in (("child", False), ("daemon", True)):
    proc = subprocess.Popen(sleeper, start_new_session=new_session)
    with open(os.path.join(sys.argv[1], f"{name}{rank}"), "w") as fh:
        fh.write(str(proc.pid))
