"""One meaning per "run" (issue #47 item 4): a *run* is one execution of a workload; its context is a
``RunContext``, held under the name ``ctx`` everywhere (``main(cfg, ctx)``, ``JobPlan.ctx``, ``launch(..., ctx=...)``),
and ``multigpu.run.Run`` (the harness) is the only thing called ``run``.

Read with ``ast`` over ``src/multigpu``, ``examples``, ``tests`` and ``benchmarks``: a parameter annotated ``RunContext``, a name bound to what
makes or reads one (``RunContext(...)``, ``context.current()``, ``mg.run_context()``, ``script_context(...)``,
``run_context_for(...)``) and a keyword argument given one of those (also as a dict's key, for ``**kwargs``) are
all named ``ctx``; a ``JobPlan``'s is ``plan.ctx``. Before, ``run`` meant a
RunContext in the launcher (``launch(run=...)``, ``JobPlan.run``), the runtime (``run = context.current()``), the
meters and the test harness, beside ``Run`` in the workloads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = [ROOT / "src" / "multigpu", ROOT / "examples", ROOT / "tests", ROOT / "benchmarks"]
MAKERS = {"RunContext", "current", "run_context", "script_context", "run_context_for"}
LEFT: set[tuple[str, str]] = set()  # none left: Trainer(ctx=...) and build(ctx=...) since the strategies' merge


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    return None


def _is_context(annotation: ast.AST) -> bool:
    """``RunContext``, ``context.RunContext`` or either ``| None`` (not a callable that takes one)."""
    return ast.unparse(annotation).removesuffix(" | None").rpartition(".")[2] == "RunContext"


def _makes_context(node: ast.AST | None) -> bool:
    if isinstance(node, ast.IfExp):
        return _makes_context(node.body) or _makes_context(node.orelse)
    if isinstance(node, ast.BoolOp):
        return any(_makes_context(v) for v in node.values)
    return _call_name(node) in MAKERS


def _misnamed(path: Path, source: str | None = None) -> list[str]:
    """``file:line: what`` for every RunContext this file (or ``source`` as if it were this file) holds under a
    name other than ``ctx``."""
    where = path.relative_to(SCANNED[0] if SCANNED[0] in path.parents else ROOT).as_posix()
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    found = []

    def bad(name: str, line: int, what: str) -> None:
        said = f"{what} '{name}'"
        if name != "ctx" and (where, name) not in LEFT and (where, said) not in LEFT:
            found.append(f"{where}:{line}: {said}")

    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                if arg.annotation is not None and _is_context(arg.annotation):
                    bad(arg.arg, arg.lineno, f"parameter of {node.name}()")
        elif isinstance(node, ast.Assign) and _makes_context(node.value):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    bad(target.id, node.lineno, "name")
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not node.target.id.isupper():
            if _is_context(node.annotation):
                bad(node.target.id, node.lineno, "field or name")
        elif isinstance(node, ast.Attribute) and node.attr == "run" and (
                isinstance(node.value, ast.Name) and node.value.id == "plan"
                or isinstance(node.value, ast.Attribute) and node.value.attr == "plan"):
            found.append(f"{where}:{node.lineno}: JobPlan's run context is plan.ctx, not plan.run")
        elif isinstance(node, ast.Dict):  # keyword arguments given as a dict (``run_on_ranks(..., **SHARED)``)
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and _makes_context(value):
                    bad(key.value, node.lineno, "key")
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg is not None and _makes_context(keyword.value) or (
                        keyword.arg == "run" and isinstance(keyword.value, ast.Name) and keyword.value.id == "ctx"):
                    bad(keyword.arg, node.lineno, f"keyword of {ast.unparse(node.func)}()")
    return found


def test_a_run_context_is_always_called_ctx():
    found = [m for base in SCANNED for path in sorted(base.rglob("*.py")) for m in _misnamed(path)]
    assert not found, "a RunContext held under another name than ctx ('run' is the harness, multigpu.run.Run):\n" \
        + "\n".join(found)


@pytest.mark.parametrize("source,expected", [
    ("def f(run: RunContext | None = None): ...\n", ["parameter of f() 'run'"]),
    ("run = context.current()\n", ["name 'run'"]),
    ("run = ctx or mg.run_context()\n", ["name 'run'"]),
    ("class P:\n    run: RunContext\n", ["field or name 'run'"]),
    ("class W:\n    main: Callable[[Any, RunContext], int]\n_CURRENT: RunContext | None = None\n", []),
    ("launch(cfg, t, [], run=RunContext(run_dir='x'))\n", ["keyword of launch() 'run'"]),
    ("run_ensemble(cfg, run=ctx)\n", ["keyword of run_ensemble() 'run'"]),
    ("SHARED = {'env': {}, 'run': RunContext(isolated=True)}\n", ["key 'run'"]),
    ("def check(cfg, plan):\n    return plan.run.resume, job.plan.run.run_dir\n", ["plan.ctx", "plan.ctx"]),
    ("def f(ctx: RunContext):\n    ctx = context.current()\n    run = Run(ctx)\n", []),
])
def test_the_scan_finds_what_it_is_meant_to(source, expected):
    """The scan itself, on a module as if it were ``multigpu/sim/probe.py``: it cannot pass by finding nothing."""
    found = _misnamed(SCANNED[0] / "sim" / "probe.py", source)
    assert len(found) == len(expected) and all(e in f for e, f in zip(expected, found, strict=True)), found
