"""Imports point one way: the command line builds on the job layer, the job layer on the argument
building below both, and the config loader (a foundation module) on nothing above it; and no module of
``src/multigpu`` reaches itself again through its imports (no import circle).

Read from the source with ``ast`` (every import, at module level or inside a function), so an import made
only when a function runs counts too: ``python -m pytest tests/unit/test_layering.py``.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

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


def _module_paths() -> dict[str, Path]:
    """``multigpu.runtime.group`` -> its file, for every module of ``src/multigpu`` (a package: its ``__init__.py``)."""
    modules = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, relative imports made absolute."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    anchor = package[: len(package) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))


def _handed_on(modules: dict[str, Path]) -> dict[str, dict[str, tuple[str, str]]]:
    """For each package, the names its ``__init__.py`` hands on: ``{name: (module it comes from, its name there)}``."""
    faces = {}
    for module, path in modules.items():
        if path.name != "__init__.py":
            continue
        names = faces[module] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                names.update({alias.asname or alias.name: (source, alias.name) for alias in node.names})
    return faces


def _import_graph() -> dict[str, dict[str, int]]:
    """``{module: {module it imports: line}}`` over ``src/multigpu``: every import of the file, at module level,
    inside a function or under ``if TYPE_CHECKING:`` (a circle of type-only imports is a circle in what a reader
    must hold in mind at once). A name taken from a package that only hands it on (``from multigpu import init``,
    ``mg.init`` after ``import multigpu as mg``) is an arrow to the module that defines it, not to the package's
    ``__init__.py``: a module that uses ``mg.init`` depends on the group, not on every workload the package
    names."""
    modules = _module_paths()
    faces = _handed_on(modules)

    def target(module: str, name: str, seen: frozenset = frozenset()) -> str | None:
        if f"{module}.{name}" in modules:
            return f"{module}.{name}"
        if (module, name) not in seen and name in faces.get(module, {}):
            return target(*faces[module][name], seen | {(module, name)})
        return module if module in modules else None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bound = {}  # a package imported whole (``import multigpu as mg``): the local name -> the package
        edges = graph[module] = {}
        for node in ast.walk(tree):
            found: list[str | None] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in faces and alias.asname:
                        bound[alias.asname] = alias.name
                    elif alias.name in faces and "." not in alias.name:
                        bound[alias.name] = alias.name
                    else:
                        found.append(alias.name if alias.name in modules else None)
            elif isinstance(node, ast.ImportFrom):
                source = _absolute(module, path, node)
                found += [target(source, alias.name) for alias in node.names]
            for name in found:
                if name is not None and name != module:
                    edges.setdefault(name, node.lineno)
        used = set()
        for node in ast.walk(tree):  # what the whole packages bound above are used for: mg.init, mg.train
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                used.add(node.value.id)
                name = target(bound[node.value.id], node.attr)
                if name is not None and name != module:
                    edges.setdefault(name, node.lineno)
        for local in set(bound) - used:  # bound but never read by attribute: the package itself
            edges.setdefault(bound[local], 0)
    return graph


def test_the_import_graph_has_no_circle():
    """No module reaches itself again through its imports. A circle ties the modules on it into one piece that
    cannot be read, tested or moved apart (runtime.group and runtime.collectives each imported the other, by
    way of shutdown's barrier; fakecuda's devices and tensors each other, one of them for a type only)."""
    graph = _import_graph()
    assert graph["multigpu.runtime.collectives"], "the graph found no import of collectives.py: it reads nothing"
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as exc:
        circle = exc.args[1][::-1]  # graphlib lists each module before those that import it
        ties = [f"{_module_paths()[a].relative_to(SRC.parent)}:{graph[a][b]} imports {b}"
                for a, b in zip(circle, circle[1:], strict=False)]
        pytest.fail("import circle: " + " -> ".join(circle) + "\n  " + "\n  ".join(ties))
