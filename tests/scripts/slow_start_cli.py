"""``python tests/scripts/slow_start_cli.py DELAY multigpu-args...``: the real command line, with torch's agent
slowed down while it starts the workers (DELAY seconds after each one), so that a test can signal the launcher
while some workers are started and the others are not (the start-up signal test)."""

import subprocess
import sys
import time

from multigpu.cli import main

delay = float(sys.argv[1])
_start = subprocess.Popen.__init__


def _slow_start(self, *args, **kwargs):
    _start(self, *args, **kwargs)
    time.sleep(delay)


subprocess.Popen.__init__ = _slow_start
sys.exit(main(sys.argv[2:]))
