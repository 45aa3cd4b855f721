"""One meter and one loading path for every workload (issue 47, item 1): the run harness (``multigpu.run.Run``)
owns both. A workload's code (train, sim, rl, envs, infer) never builds a ``StepMeter`` of its own (it uses
``run.meter``: one cadence, one trimming of ``metrics.jsonl`` on resume, the launcher's sampler and ``--profile``)
and never opens the checkpoint store to resume (``Run.load``, or ``Run.read`` then ``Run.apply``). Before,
envs/job.py and infer/runner.py built their own meters and sim/checkpoint.py opened the store when it was given no
run."""

from __future__ import annotations

import ast
from pathlib import Path

import multigpu

WORKLOADS = ("train", "sim", "rl", "envs", "infer")
ALLOWED = {
    # a finished run's newest checkpoint read as a policy module (an export for the user, not a run resuming)
    ("rl/ppo.py", "CheckpointStore", "load_policy"),
}


def _calls(name: str) -> list[tuple[str, str, str]]:
    """(file, name, enclosing function) of every call of ``name`` or ``name.attribute`` in a workload's code."""
    root = Path(multigpu.__file__).parent
    found = []
    for folder in WORKLOADS:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
                for node in ast.walk(func):
                    if not isinstance(node, ast.Call):
                        continue
                    target = node.func.value if isinstance(node.func, ast.Attribute) else node.func
                    if isinstance(target, ast.Name) and target.id == name:
                        found.append((path.relative_to(root).as_posix(), name, func.name))
    return sorted(set(found))


def test_no_workload_builds_a_step_meter_of_its_own():
    assert _calls("StepMeter") == []


def test_no_workload_opens_the_checkpoint_store_to_resume():
    assert [c for c in _calls("CheckpointStore") if c not in ALLOWED] == []
    assert _calls("Checkpointer") == []
