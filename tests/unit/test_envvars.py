"""Every ``MULTIGPU_*`` name is defined and documented once (multigpu.envvars), and the test harness reaches
production through arguments, never through a variable that production reads."""

from __future__ import annotations

import os
import re

from multigpu import envvars
from multigpu.testing import run_on_ranks
from tests.conftest import ROOT

SRC = ROOT / "src" / "multigpu"
NAME = re.compile(r"MULTIGPU_[A-Z_]+")


def test_every_multigpu_variable_the_package_names_is_defined_and_documented_in_envvars():
    defined = {getattr(envvars, name) for name in envvars.__all__}
    assert all(value.startswith("MULTIGPU_") for value in defined)
    assert len(defined) <= 8, f"the contract allows 8 MULTIGPU_* names; pass the rest in the run file: {defined}"
    for value in defined:  # a row of the docstring's table each
        assert re.search(rf"^``{value}``\s", envvars.__doc__, re.MULTILINE), f"{value} has no row in the table"
    named = {}
    for path in SRC.rglob("*.py"):
        for name in NAME.findall(path.read_text(encoding="utf-8")):
            named.setdefault(name, []).append(str(path.relative_to(SRC)))
    undefined = {name: files for name, files in named.items() if name not in defined}
    # the docstring also names the test suite's own variables, which nothing in the package reads
    tests_only = set(re.findall(r"``(MULTIGPU_(?:TEST_[A-Z]+|SOAK_ITERS))``", envvars.__doc__))
    assert set(undefined) <= tests_only and all(files == ["envvars.py"] for name, files in undefined.items()
                                                if name in tests_only), undefined


def test_the_worker_wrappers_copies_match_envvars():
    """The worker wrapper runs before multigpu may be imported, so it spells the names it reads itself."""
    from multigpu.launch import _worker

    copies = {name: value for name, value in vars(_worker).items() if name.endswith("_VAR")}
    assert copies == {"LAUNCHER_PID_VAR": envvars.LAUNCHER_PID, "DEVICE_MAP_VAR": envvars.DEVICE_MAP,
                      "RUN_FILE_VAR": envvars.RUN_FILE, "STACKS_DIR_VAR": envvars.STACKS_DIR,
                      "DEBUG_VAR": envvars.DEBUG}


def _multigpu_variables() -> list[str]:
    import multigpu as mg

    return [mg.world_size(), sorted(k for k in os.environ if k.startswith("MULTIGPU_") and "_TEST_" not in k)]


def test_run_on_ranks_forms_its_group_without_a_variable_that_production_reads():
    """The harness passes its file rendezvous to ``mg.init(init_method=...)``; it used to set
    ``MULTIGPU_INIT_METHOD``, which production ``mg.init`` read."""
    assert run_on_ranks(_multigpu_variables, 2) == [[2, []], [2, []]]
