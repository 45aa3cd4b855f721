"""Imports point one way: the command line builds on the job layer, the job layer on the argument
building below both, and the config loader (a foundation module) on nothing above it.

Read from the source with ``ast`` (every import, at module level or inside a function), so an import made
only when a function runs counts too: ``python -m pytest tests/unit/test_layering.py``.
"""

from __future__ import annotations

import ast

import pytest

from tests.conftest import ROOT

SRC = ROOT / "src" / "multigpu"


def _imports(path) -> set[str]:
    """Every ``multigpu...`` module ``path`` imports (``from multigpu.x import y`` counts as multigpu.x and
    multigpu.x.y: y may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in found if name.startswith("multigpu")}


def _files(*places: str):
    for place in places:
        path = SRC / place
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _reaching(places: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(SRC)} imports {name}" for path in _files(*places) for name in sorted(_imports(path))
            if any(name == f or name.startswith(f + ".") for f in forbidden)]


@pytest.mark.parametrize(("places", "forbidden"), [
    (("jobs", "launch", "cmdline.py"), ("multigpu.cli",)),  # was: jobs/command.py -> cli (add_flag, launch flags)
    (("config.py", "presets", "cmdline.py", "argtypes.py", "envvars.py", "errors.py"),
     ("multigpu.jobs", "multigpu.cli", "multigpu.launch")),  # was: config.py -> jobs/presets.py
    (("runtime",), ("multigpu.jobs", "multigpu.cli", "multigpu.launch", "multigpu.testing")),
    (("run",), ("multigpu.jobs", "multigpu.cli", "multigpu.launch", "multigpu.testing", "multigpu.train",
                "multigpu.sim", "multigpu.rl", "multigpu.infer", "multigpu.envs")),
    (("checkpoint",), ("multigpu.run", "multigpu.jobs", "multigpu.cli", "multigpu.launch", "multigpu.testing",
                       "multigpu.train", "multigpu.sim", "multigpu.rl", "multigpu.infer", "multigpu.envs")),
], ids=["job-layer-and-launcher-below-cli", "foundation-below-all", "runtime-below-launcher",
        "run-harness-below-workloads", "checkpoints-below-run-harness"])
def test_no_import_points_back_up(places, forbidden):
    assert _reaching(places, forbidden) == []
