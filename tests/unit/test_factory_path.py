"""A factory of the working directory imports as under ``python -m``, but after installed modules.

The README's own `--model examples.byo_train:regressor` failed from the repository root under the `multigpu`
console script ("No module named 'examples'"), whose sys.path holds its bin folder, not the working directory.
"""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT

_AS_CONSOLE_SCRIPT = """
import sys
sys.path[:] = [p for p in sys.path if p not in ('', '.')]   # what a console script's sys.path lacks
from multigpu.factory import import_object
print(import_object('examples.byo_train:regressor', what='model.factory').__name__)
print(import_object('json:dumps').__module__, sys.path.index(sys.path[-1]) == len(sys.path) - 1)
"""


def test_a_working_directory_factory_imports_without_the_folder_on_the_path():
    proc = subprocess.run([sys.executable, "-c", _AS_CONSOLE_SCRIPT], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["regressor", "json", "True"]


def test_an_installed_module_wins_over_a_same_named_file_here(tmp_path):
    (tmp_path / "json.py").write_text("raise SystemExit('the file in the working directory was imported')\n")
    code = _AS_CONSOLE_SCRIPT.splitlines()
    script = "\n".join([*code[:4], "print(import_object('json:dumps').__module__)"])
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "json", proc.stderr[-2000:]
