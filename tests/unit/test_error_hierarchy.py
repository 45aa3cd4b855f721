"""The error hierarchy is complete in one place: every public exception class of ``src/multigpu`` is defined in
``multigpu/errors.py``, exported there and drawn in its docstring's tree (which the errors reference page shows).

Pins issue #47: the tree in errors.py omitted the classes defined elsewhere (the checkpoint errors in
checkpoint/files.py and store.py, the node errors in launch/nodes.py, the watchdog's StallError, the test
harness's RankFailedError, fakecuda's StreamOrderError and CudaInitialized).
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

from multigpu import errors

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "multigpu"


def _exception_classes() -> dict[str, list[str]]:
    """Public class name -> the files defining it, for every class that derives from an exception (read with ast:
    a base is a builtin exception, a name ending in Error, or another such class of the package)."""
    bases: dict[str, list[str]] = {}
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                where.setdefault(node.name, []).append(str(path.relative_to(PACKAGE.parent)))

    def is_exception(name: str, seen: frozenset = frozenset()) -> bool:
        for base in bases.get(name, []):
            builtin = getattr(builtins, base, None)
            if (isinstance(builtin, type) and issubclass(builtin, BaseException)) or base.endswith("Error"):
                return True
            if base not in seen and is_exception(base, seen | {name}):
                return True
        return False

    return {name: where[name] for name in bases if not name.startswith("_") and is_exception(name)}


def test_every_exception_class_is_defined_in_errors_py():
    found = _exception_classes()
    elsewhere = {name: files for name, files in found.items() if files != ["multigpu/errors.py"]}
    assert not elsewhere, f"exception classes defined outside multigpu/errors.py: {elsewhere}"
    assert set(found) == set(errors.__all__)  # the scan sees the whole hierarchy: it cannot pass by finding nothing


def test_errors_py_exports_and_draws_every_class_it_defines():
    defined = {name for name, obj in vars(errors).items()
               if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__}
    assert defined == set(errors.__all__)
    drawn = set(re.findall(r"^\s*[*x+] (\w+)", errors.__doc__ or "", flags=re.M))
    assert drawn == defined, (sorted(defined - drawn), sorted(drawn - defined))
