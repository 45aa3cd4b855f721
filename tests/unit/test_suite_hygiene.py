"""The suite's own contracts: a random draw comes again from its printed seed, hypothesis runs the same examples
under ``make test``, and a green run says what it could not test here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT, SEED_VAR

_DRAWS = '''
import os
import pytest
from hypothesis import given, strategies as st

@pytest.fixture(autouse=True)
def _clean_runtime():  # the suite's own imports torch to end a process group: there is none here
    yield

def test_draw(fault_rng):
    with open(os.environ["DRAWS"], "a") as fh:
        fh.write(f"kill {fault_rng.randint(0, 10**9)}\\n")

@given(st.integers())
def test_examples(n):
    with open(os.environ["DRAWS"], "a") as fh:
        fh.write(f"example {n}\\n")

def test_needs_two_gpus():
    pytest.skip("needs 2 CUDA GPU(s), found 0")

@pytest.mark.skipif(True, reason="needs 2 CUDA GPU(s), found 0")
def test_also_needs_two_gpus():
    pass

def test_partly_here(request):
    from conftest import not_tested_here

    not_tested_here(request, "the page in a browser: no chromium")
'''


def _inner_pytest(folder, *args, env=None) -> tuple[str, list[str]]:
    """pytest on ``folder`` (this suite's conftest beside a small test file) in a fresh process: its header and
    what its tests drew. Nothing of this session's own state goes with it (its seed, shared folder, xdist role)."""
    draws = folder / "draws.txt"
    draws.unlink(missing_ok=True)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("MULTIGPU_TEST_", "PYTEST_"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--assert=plain", *args, str(folder)],
                          capture_output=True, text=True, timeout=120, cwd=folder,
                          env={**clean, "DRAWS": str(draws), **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, draws.read_text().splitlines()


def test_a_random_draw_comes_again_from_the_seed_the_run_printed(tmp_path):
    """The fault tests drew their kill steps with ``random.Random()``: a failure at one step could not be
    replayed. Now the header prints the session's seed, the main process hands it to its xdist workers, and
    ``--fault-seed`` (``make test FAULT_SEED=N``) or the variable draws the same again. Hypothesis, under the
    profile ``make test`` loads, draws the same examples every run. The run's last lines also say what it could not
    test in this environment (it skipped silently: no root, no ``cc``, no AVX, no chromium, no cgroup v2)."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "test_draws.py").write_text(_DRAWS)
    header, first = _inner_pytest(tmp_path, "-n", "2", "--hypothesis-profile=ci")
    seed = int(re.search(r"fault seed: (\d+) \(random kill steps of 1 test\(s\); --fault-seed \1, ", header)[1])
    # and the last line says what was not tested here, skipped or in part (the summary adds up xdist's workers)
    assert header.strip().splitlines()[-2] == ("not tested here: 3 (needs 2 CUDA GPU(s), found 0 (2); "
                                               "the page in a browser: no chromium (1))"), header
    _, again = _inner_pytest(tmp_path, "--fault-seed", str(seed), "--hypothesis-profile=ci")
    _, other = _inner_pytest(tmp_path, "-k", "not examples", env={SEED_VAR: str(seed + 1)})
    kills = [line for line in first if line.startswith("kill")]
    examples = [line for line in first if line.startswith("example")]
    assert len(kills) == 1 and len(examples) > 10
    assert sorted(again) == sorted(first)  # the same kill step and the same hypothesis examples
    assert len(other) == 1 and other != kills  # another seed (from the variable) draws another step


def test_make_test_loads_the_derandomized_hypothesis_profile():
    from hypothesis import settings

    assert settings.get_profile("ci").derandomize and settings.get_profile("ci").deadline is None
    recipe = subprocess.run(["make", "-n", "test", "test-quick", "FAULT_SEED=7"], capture_output=True, text=True,
                            cwd=ROOT, timeout=60).stdout
    pytest_lines = [line for line in recipe.splitlines() if " -m pytest " in line]
    assert len(pytest_lines) == 2 and all("--hypothesis-profile=ci --fault-seed 7" in line for line in pytest_lines)



def test_the_longest_files_start_first_and_each_files_tests_stay_together():
    """``make test`` hands whole files to its two workers in this order (``--dist loadscope``): the recorded
    longest first, an unrecorded file by its tests' markers, ties and each file's own tests in collection order."""
    from types import SimpleNamespace

    from tests.conftest import file_order

    def item(nodeid, *marks):
        return SimpleNamespace(nodeid=nodeid, iter_markers=lambda: [SimpleNamespace(name=m) for m in marks])

    items = [item("a.py::t1"), item("b.py::t1", "e2e"), item("a.py::t2"), item("c.py::t1"), item("b.py::t2"),
             item("d.py::t1", "dist"), item("e.py::t1", "slow"), item("f.py::t1"), item("f.py::t2")]
    order = [i.nodeid for i in file_order(items, {"a.py": 100.0, "c.py": 0.1})]
    assert order == ["a.py::t1", "a.py::t2",   # recorded 100 s
                     "e.py::t1",               # slow: 60
                     "b.py::t1", "b.py::t2",   # 2 x e2e: 30
                     "d.py::t1",               # dist: 8
                     "f.py::t1", "f.py::t2",   # 2 x 0.2
                     "c.py::t1"]               # recorded 0.1


def test_the_cluster_tiers_files_are_one_unit_of_work_weighed_together():
    """The cluster tier's files run on one worker, one after another (each worker made its own SLURM, and two of
    them side by side starved the jobs' start-up): one unit, placed by the sum of its files' seconds, its files
    longest first; the scheduler gives the unit's tests one scope."""
    from types import SimpleNamespace

    from tests.conftest import file_order, pytest_xdist_make_scheduler, unit_scheduling, work_unit

    def item(nodeid):
        return SimpleNamespace(nodeid=nodeid, iter_markers=lambda: [])

    items = [item("tests/cluster/test_a.py::t"), item("tests/x.py::t"), item("tests/cluster/test_b.py::t"),
             item("tests/y.py::t")]
    recorded = {"tests/cluster/test_a.py": 30.0, "tests/cluster/test_b.py": 40.0, "tests/x.py": 60.0,
                "tests/y.py": 50.0}
    order = [i.nodeid for i in file_order(items, recorded)]
    assert order == ["tests/cluster/test_b.py::t", "tests/cluster/test_a.py::t", "tests/x.py::t", "tests/y.py::t"]
    assert work_unit("tests/cluster/test_a.py::t") == work_unit("tests/cluster/test_b.py::t") == "tests/cluster"
    assert work_unit("tests/x.py::t") == "tests/x.py"
    cls = unit_scheduling()
    scheduler = cls.__new__(cls)  # its scope of a test needs nothing of a running session
    assert scheduler._split_scope("tests/cluster/test_a.py::t") == scheduler._split_scope("tests/cluster/test_b.py::u")
    assert scheduler._split_scope("tests/x.py::t") == "tests/x.py"
    assert pytest_xdist_make_scheduler(SimpleNamespace(getoption=lambda name, default=None: "load"), None) is None


def test_make_test_quick_is_the_pure_tier_without_the_slow_tests():
    """docs/testing.md: ``make test-quick`` runs the pure tier (tests/unit, tests/fakecuda) and nothing marked
    dist, e2e or slow. The GPU rehearsal (a minute of set-up) and the compiled-kernel test ran in it unmarked."""
    recipe = subprocess.run(["make", "-n", "test-quick"], capture_output=True, text=True, cwd=ROOT, timeout=60).stdout
    [line] = [line for line in recipe.splitlines() if " -m pytest " in line]
    args = line.split(" -m pytest ", 1)[1]
    assert re.search(r'-m "not dist and not e2e and not slow"', args), args
    assert args.rstrip().endswith("tests/unit tests/fakecuda"), args
    assert "--dist loadscope --no-loadscope-reorder" in line
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
         "not dist and not e2e and not slow", "tests/unit/test_gpu_benchmarks.py", "tests/unit/test_sim_native.py"],
        capture_output=True, text=True, cwd=ROOT, timeout=120).stdout
    ids = [line for line in collected.splitlines() if "::" in line]
    assert ids and not [i for i in ids if "rehearsal" in i or "quick" in i or "compiled_config" in i], ids
    assert any("test_a_step_whose_estimate_exceeds_its_cap_fails_the_budget" in i for i in ids)
