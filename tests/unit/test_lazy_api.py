"""``import multigpu as mg`` loads only the runtime; ``mg.train``, ``mg.infer``, ... load on first use."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import multigpu as mg

# each lazy attribute with one name its subpackage exports (its main entry point)
ENTRY_POINTS = {
    "bench": "run_bench",
    "envs": "make",
    "infer": "sliding_window",
    "monitor": "StepMeter",
    "rl": "train",
    "run": "Run",
    "sim": "run",
    "train": "Trainer",
    "verify": "record",
}

_FRESH_PROCESS = """
import json, sys
import multigpu as mg
loaded = sorted(m for m in sys.modules if m.startswith("multigpu."))
print(json.dumps({"loaded": loaded, "sliding_window": callable(mg.infer.sliding_window)}))
"""


def test_import_multigpu_loads_no_workload_and_the_attribute_still_resolves():
    # a fresh interpreter: in this one other tests have imported the workloads already
    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    eager = [m for m in out["loaded"] if m.split(".")[1] in ENTRY_POINTS]
    assert eager == [], f"import multigpu imported workload modules: {eager}"
    assert out["sliding_window"] is True


@pytest.mark.parametrize("name,entry_point", sorted(ENTRY_POINTS.items()))
def test_each_workload_is_an_attribute_with_its_entry_point(name, entry_point):
    module = getattr(mg, name)
    assert module.__name__ == f"multigpu.{name}"
    assert callable(getattr(module, entry_point))
    assert name in dir(mg)  # tab completion sees it before it is imported too


def test_an_unknown_attribute_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'multigpu' has no attribute 'nonexistent'"):
        mg.nonexistent  # noqa: B018
    assert "init" in dir(mg) and "nonexistent" not in dir(mg)
