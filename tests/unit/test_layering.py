"""Imports point one way, down the layers docs/architecture.md draws (its table is the rule: this test reads it
from the page), and no module of ``src/multigpu`` reaches itself again through its imports (no import circle).

Read from the source with ``ast`` (every import, at module level or inside a function), so an import made
only when a function runs counts too: ``python -m pytest tests/unit/test_layering.py``. Before, five hand-picked
rules held and the folders looped once function-level imports counted (launch -> jobs.rundir, jobs -> dryrun ->
train/sim/infer -> jobs, bench <-> report, plan <-> report, sim -> bench, monitor -> checkpoint).
"""

from __future__ import annotations

import ast
import graphlib
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

SRC = ROOT / "src" / "multigpu"


ARCHITECTURE = ROOT / "docs" / "architecture.md"
TYPE_ONLY_UP = 6
"""Type-only imports (``if TYPE_CHECKING:``) that may point up: the package's lazily loaded submodules, named for
type checkers in its ``__init__.py``."""


def _layers() -> dict[str, int]:
    """``{folder or module: layer}`` from the table under "The layers and their rule" in docs/architecture.md
    (``cli/`` -> ``cli``, ``config.py`` -> ``config``, the package's ``__init__.py`` -> ``multigpu``)."""
    text = ARCHITECTURE.read_text(encoding="utf-8")
    section = text[text.index("## The layers and their rule"):]
    section = section[:section.index("\n## ", 4)]
    layers = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].isdigit():
            for name in re.findall(r"`([^`]+)`", cells[1]):
                unit = "multigpu" if name == "__init__.py" else name.removesuffix("/").removesuffix(".py")
                layers[unit] = int(cells[0])
    return layers


def _unit(module: str) -> str:
    """The folder (or top-level module) a module belongs to: ``multigpu.launch.agent`` -> ``launch``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "multigpu"


def _type_only(path: Path) -> set[int]:
    """The line numbers of the imports under ``if TYPE_CHECKING:`` in ``path``."""
    lines = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            lines |= {n.lineno for body in node.body for n in ast.walk(body) if isinstance(n, ast.Import | ast.ImportFrom)}
    return lines


def test_every_import_points_down_the_layers_the_architecture_page_draws():
    layers, graph, paths = _layers(), _import_graph(), _module_paths()
    units = {_unit(m) for m in paths}
    assert not units - set(layers), f"docs/architecture.md's layer table does not place {sorted(units - set(layers))}"
    up, type_only = [], []
    for module, targets in graph.items():
        lines = _type_only(paths[module])
        for target, line in targets.items():
            a, b = _unit(module), _unit(target)
            if layers[b] < layers[a]:  # a smaller number is a higher layer
                where = f"{paths[module].relative_to(SRC.parent)}:{line} imports {target} (layer {layers[b]} " \
                        f"above {a}'s {layers[a]})"
                (type_only if line in lines else up).append(where)
    assert up == [], "imports that point up:\n  " + "\n  ".join(up)
    assert len(type_only) <= TYPE_ONLY_UP and all(w.startswith("multigpu/__init__.py") for w in type_only), type_only


def test_the_layer_rule_fails_on_an_import_that_points_up(monkeypatch):
    """The rule can fail: the run harness (layer 9) importing the launcher (8) above it is named."""
    graph = _import_graph()
    graph["multigpu.run.harness"]["multigpu.launch.agent"] = 7
    monkeypatch.setattr(sys.modules[__name__], "_import_graph", lambda: graph)
    with pytest.raises(AssertionError, match=r"run/harness.py:7 imports multigpu.launch.agent \(layer 8 above run"):
        test_every_import_points_down_the_layers_the_architecture_page_draws()


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
