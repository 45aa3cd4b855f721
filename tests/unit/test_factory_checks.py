"""A factory's launcher-side check is an explicit part of the factory protocol (``multigpu.factory``): declared
where the factory is defined (``@checked_by(check)``), documented (:class:`CheckedFactory`), and run by
``Factory.check`` in the launcher. Pins issue #47: six built-in factories got a ``check`` attribute by an
assignment after their definition (``gpt.check = _check_gpt``) that no protocol named."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from multigpu.errors import ConfigError
from multigpu.factory import CheckedFactory, Factory, checked_by

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "multigpu"


def _check_make(width: int = 1) -> None:
    if width < 1:
        raise ConfigError(f"width={width} must be >= 1")


@checked_by(_check_make)
def make(width: int = 1) -> int:
    return width


def test_a_factory_checked_by_a_function_is_checked_in_the_launcher():
    assert isinstance(make, CheckedFactory) and make.check is _check_make and make(width=3) == 3
    Factory(factory=f"{__name__}:make", kwargs={"width": 2}).check("model.factory")
    with pytest.raises(ConfigError, match="width=0 must be >= 1"):
        Factory(factory=f"{__name__}:make", kwargs={"width": 0}).check("model.factory")


def test_the_built_in_factories_declare_their_checks():
    from multigpu.train import data, hf, nano

    built_in = [data.stdlib_text, data.token_files, data.bytes_file, hf.causal_lm, hf.saved_dataset, nano.gpt]
    assert all(isinstance(f, CheckedFactory) for f in built_in)
    with pytest.raises(ConfigError, match="n_head"):  # the check runs, not the factory: no model is built
        Factory(factory="multigpu.train.nano:gpt", kwargs={"n_embd": 30, "n_head": 4}).check(
            "model.factory", {"vocab_size": 65})


def test_no_module_sets_a_check_attribute_by_assignment():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "factory.py":
            continue  # checked_by's own
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                found += [f"{path.relative_to(PACKAGE)}:{node.lineno}" for t in targets
                          if isinstance(t, ast.Attribute) and t.attr == "check"]
    assert not found, f"a check given by assignment, not @checked_by: {found}"
