"""What the launcher imports before it spawns (it once made `multigpu train` start 1.5 s after raw torchrun).

Building the parser used to import every workload; the simulation's pulled in
torch.distributed.checkpoint, DTensor and sympy, seconds of CPU on every launch.
`main` now builds only the named command. These pin that down in a fresh
interpreter (sys.modules is the evidence, no timing), and check that the full
parser is still built where the user needs to see every command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT

_PROBE = """
import json, sys
import multigpu.launch.agent as agent
agent._elastic_launch = lambda config, entrypoint, args: {}
from multigpu.cli import main
code = main(sys.argv[2:])
names = ("multigpu.sim", "multigpu.infer", "multigpu.rl", "multigpu.train.trainer", "multigpu.monitor",
         "torch.distributed.checkpoint", "sympy")
json.dump({"code": code, "loaded": [n for n in names if n in sys.modules]}, open(sys.argv[1], "w"))
"""


def test_train_launch_imports_no_other_workload(tmp_path):
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    argv = ["train", "-f", "nano", "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), "steps=2"]
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(out), *argv], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == {"code": 0, "loaded": []}


def test_help_and_a_mistyped_command_still_list_every_command(capsys):
    from multigpu.cli import _command_of, commands, main

    assert commands() == ["launch", "info", "train", "sim", "infer", "rl", "run", "bench", "verify", "plan", "doctor",
                          "report"]
    assert _command_of(["envs"]) is None  # a built-in workload whose entry makes it no command (bench runs it)
    assert _command_of(["--debug", "train", "-f", "nano"]) == "train" and _command_of(["trian"]) is None
    assert _command_of(["--help"]) is None and _command_of([]) is None
    assert main(["trian", "-f", "nano"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(name in err for name in commands()), err
