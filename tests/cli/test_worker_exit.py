"""A worker leaves as soon as its script has: what torch's import created is frozen out of the garbage collector
(the collections at the interpreter's exit traversed it all, ~0.4 CPU-seconds per rank after the script ended),
and what the script creates is still collected and finalized at exit, cycles and ``__del__`` included.

The wrapper is run by hand here (``python _worker.py script.py``: no launcher, one process), as it can be."""

from __future__ import annotations

import os
import subprocess
import sys

from multigpu.launch import _worker
from tests.conftest import ROOT

SCRIPT = """
import gc, sys
print("frozen", gc.get_freeze_count(), flush=True)

class Note:
    def __init__(self, path):
        self.path, self.me = path, self  # a reference cycle: only the collector frees it
    def __del__(self):
        with open(self.path, "w") as fh:
            fh.write("finalized")

keep = Note(sys.argv[1])  # held by the script's module until the interpreter's exit
"""


def test_torchs_objects_are_frozen_before_the_script_and_the_scripts_own_are_finalized_at_exit(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIGPU_", "TORCHELASTIC_"))}
    proc = subprocess.run([sys.executable, "-u", _worker.__file__, str(script), str(tmp_path / "note")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**env, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    frozen = int(proc.stdout.split("frozen ")[1].split()[0])
    assert frozen > 10_000  # torch's import, frozen before the script ran
    assert (tmp_path / "note").read_text() == "finalized"
