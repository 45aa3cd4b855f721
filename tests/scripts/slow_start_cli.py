"""``python tests/scripts/slow_start_cli.py GATE multigpu-args...``: the real command line, with torch's agent held
after it has started each worker until the file ``GATE/go`` exists (60 s at most), having written
``GATE/started<N>``: a test signals the launcher while some workers are started and the others are not (the
start-up signal test), whatever the machine's speed."""

import os
import subprocess
import sys
import time

from multigpu.cli import main

gate = sys.argv[1]
_start = subprocess.Popen.__init__
_started = 0


def _held_start(self, args, *rest, **kwargs):
    global _started
    _start(self, args, *rest, **kwargs)
    if not any(str(a).endswith("_worker.py") for a in (args if isinstance(args, (list, tuple)) else [args])):
        return  # not a worker (the launcher's reaper)
    _started += 1
    open(os.path.join(gate, f"started{_started}"), "w").close()  # noqa: SIM115
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(gate, "go")) and time.monotonic() < deadline:
        time.sleep(0.02)


subprocess.Popen.__init__ = _held_start
sys.exit(main(sys.argv[2:]))
