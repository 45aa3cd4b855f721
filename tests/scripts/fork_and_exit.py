"""Each rank starts two long-lived processes, a plain child and one in a session of its own (as a daemon
would), records their pids as child<R> and daemon<R>, and exits at once (the orphan test): 0, or the code given
after the folder."""
import os
import subprocess
import sys

rank = os.environ["RANK"]
sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
for name, new_session in (("child", False), ("daemon", True)):
    proc = subprocess.Popen(sleeper, start_new_session=new_session)
    with open(os.path.join(sys.argv[1], f"{name}{rank}"), "w") as fh:
        fh.write(str(proc.pid))
if len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
