"""No module of ``src/multigpu`` uses another module's private (``_``-prefixed) name (the style's one rule: public
names have no underscore and appear in ``__all__``; everything else is the module's own).

Read with ``ast``, imports inside functions included: ``from multigpu.x import _name`` and ``module._name`` on a
module imported from the package. A private *module* (``launch/_worker.py``) may be imported inside its own
package. Pins issue #47's "22 imports of 12 private names across modules" (``collectives._translate`` by four
simulation modules, ``infer.runner._Packed`` by the infer job, ...): each was made public or moved.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "multigpu"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    base = SRC.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _inside(importer: str, package: str) -> bool:
    return importer == package or importer.startswith(package + ".")


def _uses(path: Path, source: str | None = None) -> list[str]:
    """``file:line: what`` for every private name of another module this file (or ``source`` as if it were this
    file) uses."""
    here = _module_name(path)
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    found, modules = [], {}  # local name -> the multigpu module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("multigpu"):
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                if _is_module(target):
                    modules[alias.asname or alias.name] = target
                    if _private(alias.name) and not _inside(here, node.module):
                        found.append(f"{path.relative_to(SRC)}:{node.lineno}: private module {target}")
                elif _private(alias.name) and node.module != here:
                    found.append(f"{path.relative_to(SRC)}:{node.lineno}: {target}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("multigpu") and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in modules and modules[node.value.id] != here):
            target = f"{modules[node.value.id]}.{node.attr}"
            if not (_is_module(target) and _inside(here, modules[node.value.id])):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {target}")
    return found


def test_no_module_uses_another_modules_private_names():
    found = [use for path in sorted(PACKAGE.rglob("*.py")) for use in _uses(path)]
    assert not found, "private names used across modules (make them public, in __all__, or move them):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("source,expected", [
    ("from multigpu.runtime.collectives import _translate\n", ["runtime.collectives._translate"]),
    ("def f():\n    from multigpu.runtime import group\n    group._private()\n", ["runtime.group._private"]),
    ("from multigpu.launch import _worker\n", ["private module multigpu.launch._worker"]),
    ("from multigpu.runtime.collectives import gather\n", []),
])
def test_the_scan_finds_what_it_is_meant_to(source, expected):
    """The scan itself, on a module as if it were ``multigpu/sim/probe.py``: it cannot pass by finding nothing."""
    found = _uses(PACKAGE / "sim" / "probe.py", source)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found, strict=True)), found
