"""Shared fixtures: a clean runtime and environment around every test, a one-rank group."""

from __future__ import annotations

import contextlib
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"

SEED_VAR = "MULTIGPU_TEST_SEED"
"""The session's seed of the tests' random draws (kill steps of the fault tests): ``--fault-seed N`` or this
variable reproduces a run; without either, the main pytest process draws one, prints it in the header and hands it
to its xdist workers through this variable."""

try:  # hypothesis: ``make test`` loads "ci" (the same examples every run); plain pytest explores, printing how to replay
    from hypothesis import settings as _hypothesis

    _hypothesis.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    _hypothesis.register_profile("explore", deadline=None, print_blob=True)
    _hypothesis.load_profile("explore")
except ImportError:  # the dev extra is not installed: the tests that use it skip
    pass


def pytest_addoption(parser):
    parser.addoption("--fault-seed", type=int, default=None, metavar="N",
                     help=f"seed of the fault tests' random draws (default: ${SEED_VAR}, else a fresh one, printed)")
    parser.addoption("--record-durations", action="store_true", default=False,
                     help=f"write the seconds each test file took into {DURATIONS.relative_to(ROOT)} (the order in "
                          "which files start: longest first)")


DURATIONS = ROOT / "tests" / "durations.json"
"""Seconds each test file took in a whole ``make test`` (its tests' set-up, call and tear-down, summed on 2 cores),
written by ``pytest --record-durations``: the order in which the files start, longest first."""
_MARKER_SECONDS = (("slow", 60.0), ("e2e", 15.0), ("dist", 8.0))
"""A file not recorded yet counts each of its tests by its heaviest marker (else 0.2 s)."""


def _test_file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _recorded_durations() -> dict[str, float]:
    import json

    try:
        data = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))} if isinstance(data, dict) else {}


ONE_UNIT = ("tests/cluster/",)
"""Folders whose files run as one unit of work, on one worker, one after another: the cluster tier's files share
one virtual SLURM per worker (a session fixture), and two of them side by side on a 2-core machine (4 hosts' jobs
each) slowed the ranks' start-up past SLURM's warnings and deadlines."""


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to under ``make test``: its file, or the :data:`ONE_UNIT` folder it is in."""
    name = _test_file(nodeid)
    return next((folder.rstrip("/") for folder in ONE_UNIT if name.startswith(folder)), name)


def file_order(items, recorded: dict[str, float]) -> list:
    """``items`` with the longest units of work first (:func:`work_unit`: the sum of their files' recorded seconds,
    else an estimate by marker), each unit's files longest first and each file's tests together and in their own
    order (so a module's fixtures are made once), ties in collection order."""
    estimate: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        name = _test_file(item.nodeid)
        first.setdefault(name, i)
        marks = {m.name for m in item.iter_markers()}
        estimate[name] = estimate.get(name, 0.0) + next((s for m, s in _MARKER_SECONDS if m in marks), 0.2)
    weight = {name: recorded.get(name, estimate[name]) for name in first}
    unit_weight: Counter = Counter()
    unit_first: dict[str, int] = {}
    for name, seconds in weight.items():
        unit_weight[work_unit(name)] += seconds
        unit_first.setdefault(work_unit(name), first[name])

    def key(item):
        name = _test_file(item.nodeid)
        unit = work_unit(name)
        return -unit_weight[unit], unit_first[unit], -weight[name], first[name]

    return sorted(items, key=key)


def unit_scheduling():
    """pytest-xdist's ``--dist loadscope`` scheduler with :func:`work_unit` as the scope of a :data:`ONE_UNIT`
    folder's tests (the class; xdist is imported only where it runs)."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            unit = work_unit(nodeid)
            return unit if unit != _test_file(nodeid) else super()._split_scope(nodeid)

    return UnitScheduling


def pytest_xdist_make_scheduler(config, log):
    """Under ``--dist loadscope`` (``make test``): :func:`unit_scheduling`'s, so a :data:`ONE_UNIT` folder goes to
    one worker."""
    if config.getoption("dist", None) != "loadscope":
        return None
    return unit_scheduling()(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The longest test files start first. Under ``make test`` (pytest-xdist, ``--dist loadscope`` without its own
    reordering) each file is one unit of work handed to the next free worker in this order: the long e2e and
    rehearsal files begin at once on the two workers and the many short ones fill in after, instead of a long
    file starting last and running alone. Every worker sorts alike (the same file of durations). Not under mutation
    testing (``make mutate`` runs a copy in ``mutants/``): there each mutant's few tests run as collected."""
    if ROOT.name != "mutants":
        items[:] = file_order(items, _recorded_durations())


_FILE_SECONDS: Counter = Counter()


def pytest_runtest_logreport(report):
    """Add up each test file's seconds for ``--record-durations`` (in the main process: under xdist the workers'
    reports arrive there too)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        _FILE_SECONDS[_test_file(report.nodeid)] += report.duration


def _write_durations() -> None:
    import json

    merged = {**_recorded_durations(), **{k: round(v, 1) for k, v in _FILE_SECONDS.items()}}
    DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


def session_seed(config) -> int:
    """The seed of this session's random draws (see SEED_VAR)."""
    given = config.getoption("--fault-seed")
    if given is not None:
        return given
    return int(os.environ[SEED_VAR])


def pytest_report_header(config):
    seed = session_seed(config)
    return f"fault seed: {seed} (random kill steps; --fault-seed {seed} or {SEED_VAR}={seed} draws them again)"


@pytest.fixture
def fault_rng(request) -> random.Random:
    """A random generator for this test's draws (e.g. the step a fault test kills a rank at): seeded from the
    session's seed and the test's id, so a failed draw comes again with the same ``--fault-seed``, whatever else
    ran. The seed is printed (pytest shows it with a failure's captured output)."""
    seed = session_seed(request.config)
    print(f"random draws of {request.node.nodeid}: --fault-seed {seed} draws them again")
    request.node.user_properties.append(("fault_seed", seed))  # the summary says it once, for all
    return random.Random(f"{seed}:{request.node.nodeid}")


def _seed_line(terminalreporter) -> str | None:
    """``fault seed: N ...`` when some test of the run drew with ``fault_rng``."""
    seeds = {value for reports in terminalreporter.stats.values() for r in reports
             for name, value in getattr(r, "user_properties", ()) if name == "fault_seed"}
    tests = {r.nodeid for reports in terminalreporter.stats.values() for r in reports
             if any(name == "fault_seed" for name, _ in getattr(r, "user_properties", ()))}
    if not seeds:
        return None
    seed = min(seeds)
    return (f"fault seed: {seed} (random kill steps of {len(tests)} test(s); --fault-seed {seed}, or make test "
            f"FAULT_SEED={seed}, draws them again)")

# Variables the launcher and init() may set; a test that leaks one fails.
_WATCHED_PREFIXES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_", "GROUP_RANK",
                     "MULTIGPU_", "CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE",
                     "EGL_DEVICE_ID", "OMP_NUM_THREADS", "TORCHELASTIC_")


@pytest.fixture(scope="session", autouse=True)
def _session_tmpdir(tmp_path_factory):
    """Temporary files of this session and of every process it starts go under pytest's own base folder
    (``TMPDIR``), which pytest prunes to the last three sessions: the folders a failed launch keeps on
    purpose (``multigpu_logs_*``, named in its message) do not pile up in /tmp across runs."""
    folder = tmp_path_factory.mktemp("tmp")
    before_env, before_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = str(folder)
    tempfile.tempdir = str(folder)
    yield folder
    tempfile.tempdir = before_dir
    if before_env is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before_env


@pytest.fixture(autouse=True)
def _clean_runtime():
    """Destroy any process group a test left behind and reset multigpu's runtime state."""
    yield
    import torch.distributed as dist

    from multigpu.runtime import context, group

    if group.is_initialized() or dist.is_initialized():
        group.shutdown(barrier=False)
    context.set_current(None)  # the next test reads its own run context


@pytest.fixture(autouse=True)
def _restore_env():
    """Fail a test that leaks launcher variables into os.environ (Fabric's restore_env_variables)."""
    before = dict(os.environ)
    yield
    leaked = {k: v for k, v in os.environ.items() if before.get(k) != v and k.startswith(_WATCHED_PREFIXES)}
    os.environ.clear()
    os.environ.update(before)
    assert not leaked, f"test leaked environment variables: {leaked}"


@pytest.fixture
def single_rank_group(tmp_path, monkeypatch):
    """multigpu.init() alone, plus a real one-rank gloo group on a file store (no ports).

    For code that needs torch.distributed itself (DDP, DCP) at world_size 1.
    """
    from datetime import timedelta

    import torch.distributed as dist

    import multigpu as mg

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    env = mg.init(backend="cpu", timeout_s=30)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    yield env
    mg.shutdown()


@pytest.fixture
def fake_gpus(monkeypatch):
    """``fake_gpus(n)``: the launcher sees ``n`` GPUs (and 2 cores) through its injected host-facts seam;
    ``available_bytes`` makes up this node's free memory (None: unknown, so no memory check); ``capability``
    the compute capability NVML reports for every GPU (None: no NVML)."""
    from multigpu.launch.devices import HostFacts

    def install(count: int, visible: str | None = None, cores: int = 2, available_bytes: int | None = None,
                capability: tuple[int, int] | None = None) -> HostFacts:
        facts = HostFacts(gpu_count=count, visible=visible, cores=cores, available_bytes=available_bytes,
                          gpu_capabilities=(capability,) * count if capability else None)
        monkeypatch.setattr(HostFacts, "probe", classmethod(lambda cls: facts))
        return facts

    return install


def not_tested_here(request, what: str) -> None:
    """Say that part of this test could not run in this environment (the rest did): the run's last lines group it
    with the skipped tests' reasons, so a green run says what it did not test."""
    request.node.user_properties.append(("not_tested_here", what))


def assert_bad_input(argv: list[str], message: str, capsys, written: Path | None = None) -> str:
    """The bad-input contract through the real entry point: exit 2, one ``error:`` line holding ``message``,
    and ``written`` (a run directory, an output) not created. Returns the line."""
    from multigpu.cli import main

    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, (argv, err)
    assert err.startswith("error: ") and "\n" not in err and message in err, (argv, err)
    assert written is None or not written.exists(), f"{argv} wrote {written}"
    return err


def run_file() -> dict:
    """Inside a mocked launch: the run file the launcher wrote for the workers (``MULTIGPU_RUN_FILE``)."""
    import json

    return json.loads(Path(os.environ["MULTIGPU_RUN_FILE"]).read_text())


def fault_callback(folder: Path, rank: int, step: int) -> tuple[str, dict[str, str]]:
    """A ``callbacks=[...]`` override that kills ``rank`` after ``step`` (first attempt only), and the environment
    that lets the ranks import it: a tiny module written into ``folder``."""
    (folder / "fault_here.py").write_text(
        "from multigpu.testing.faults import KillAt\n\n\n"
        f"def hook():\n    return KillAt(rank={rank}, step={step})\n")
    path = os.pathsep.join([str(folder), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])
    return "callbacks=[fault_here:hook]", {"PYTHONPATH": path}


def run_cli(*args: str, timeout: float = 180, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m multigpu ARGS`` in a subprocess (tier 3: the real launcher, real ranks)."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "multigpu", *args],
        capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd,
    )


SESSION_VAR = "MULTIGPU_TEST_SESSION"
"""Set for the whole test session, so every process a test starts inherits it (the no-process-left check).
Each pytest process (under pytest-xdist: each worker) marks its own, so each checks only what it started."""
os.environ[SESSION_VAR] = f"{os.getpid()}-{time.time_ns()}"
_SHARED_VAR = "MULTIGPU_TEST_SHARED"
"""A folder the main pytest process makes and its xdist workers inherit: each worker leaves its findings there."""
LEFT_BEHIND: list[str] = []
"""Processes started by this session that outlived it (filled at its end; the session then fails)."""
COUNTED = {"tests.fuzz.test_bad_input_suite": ("CASES", "KINDS"), "tests.faults.test_fault_suite": ("FAULTS",)}
"""Module-level counters of the two suites; each test's share travels in its report (``user_properties``), so
the summary adds them up from reports alike in one process and across xdist workers."""


_OWN_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
"""Helpers of this pytest process itself (``run_on_ranks`` spawns): they end when it ends."""


def _suite_processes() -> list[psutil.Process]:
    """Running processes that carry this session's mark: its launchers, workers, their children."""
    me = psutil.Process()
    skip = {me.pid, *(p.pid for p in me.parents())}
    found = []
    for proc in psutil.process_iter(["status", "ppid", "cmdline"]):
        if proc.pid in skip or proc.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if proc.info["ppid"] == me.pid and any(h in " ".join(proc.info["cmdline"] or []) for h in _OWN_HELPERS):
            continue
        with contextlib.suppress(psutil.Error):
            if proc.environ().get(SESSION_VAR) == os.environ[SESSION_VAR]:
                found.append(proc)
    return found


def _xdist_controller(config) -> bool:
    """The main process of a ``pytest -n N`` run: its workers carry its mark, and the tests ran in them."""
    return getattr(config.option, "dist", "no") != "no" and not os.environ.get("PYTEST_XDIST_WORKER")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Put what this test added to its suite's counters into its report."""
    names = COUNTED.get(getattr(item.module, "__name__", ""), ())
    before = {n: Counter(getattr(item.module, n)) for n in names}
    yield
    for n in names:
        added = getattr(item.module, n) - before[n]
        if added:
            item.user_properties.append((f"{item.module.__name__}.{n}", dict(added)))


def pytest_sessionfinish(session, exitstatus):
    """Fail the session if any process it started is still running (after 10 s of grace), and stop those.

    An xdist worker checks its own and leaves its findings in the shared folder; the main process reads them.
    Not under mutation testing (``make mutate``, a copy in ``mutants/``): there every mutant's session is a
    process forked from one that loaded this module, so they all carry one mark, and each would take the others
    running beside it for its own, wait for them and stop them."""
    if ROOT.name == "mutants":
        return
    shared = Path(os.environ[_SHARED_VAR])
    if _xdist_controller(session.config):
        for path in sorted(shared.glob("left_*.txt")):
            LEFT_BEHIND.extend(line for line in path.read_text().splitlines() if line)
        if LEFT_BEHIND:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
        return
    compile_pool = sys.modules.get("torch._inductor.async_compile")
    if compile_pool is not None:  # torch.compile's pool of compile workers: torch ends it at interpreter exit,
        with contextlib.suppress(Exception):  # after this check; ended here instead (the first GPU call counted it)
            compile_pool.shutdown_compile_workers()
    deadline = time.monotonic() + 10
    while (left := _suite_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            LEFT_BEHIND.append(f"{proc.pid} {' '.join(proc.cmdline())[:160]}")
        with contextlib.suppress(psutil.Error):
            proc.kill()
    if LEFT_BEHIND and os.environ.get("PYTEST_XDIST_WORKER"):
        (shared / f"left_{os.getpid()}.txt").write_text("\n".join(LEFT_BEHIND) + "\n")
    if left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config):
    if _SHARED_VAR not in os.environ:  # the main pytest process (not a rank that imports this module)
        os.environ[_SHARED_VAR] = tempfile.mkdtemp(prefix="multigpu_test_shared_")
    if config.getoption("--fault-seed") is not None:
        os.environ[SEED_VAR] = str(config.getoption("--fault-seed"))
    elif not os.environ.get(SEED_VAR, "").isdigit():  # drawn once, in the main process; xdist workers inherit it
        os.environ[SEED_VAR] = str(secrets.randbelow(2**32))


def pytest_unconfigure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        shutil.rmtree(os.environ[_SHARED_VAR], ignore_errors=True)
        if config.getoption("--record-durations") and _FILE_SECONDS:
            _write_durations()


def _counted(terminalreporter, name: str) -> tuple[Counter, list]:
    """The suite counter ``name`` summed over every report that holds it, and the failed reports of its module."""
    total: Counter = Counter()
    failed = []
    module = name.rsplit(".", 1)[0]
    for key in ("passed", "failed"):
        for r in terminalreporter.stats.get(key, []):
            if getattr(r, "when", None) != "call":
                continue
            for prop, value in r.user_properties:
                if prop == name:
                    total.update(value)
            if key == "failed" and r.nodeid.split("::")[0].replace("/", ".").removesuffix(".py") == module:
                failed.append(r)
    return total, failed


def _per(counts) -> str:
    """``a 3, b 1``: a counter's entries in name order, for the summary lines."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ").strip()


def untested_line(stats: dict) -> str | None:
    """One line: what this run could not test here, by reason, with counts (the skipped tests' reasons, and the
    parts of tests that ran without them: ``not_tested_here``); None when it tested everything. ``stats``: the
    terminal reporter's, by outcome."""
    reasons: Counter = Counter(_skip_reason(r) for r in stats.get("skipped", []))
    for outcome in ("passed", "failed"):
        for r in stats.get(outcome, []):
            if getattr(r, "when", None) == "call":
                reasons.update(value for name, value in r.user_properties if name == "not_tested_here")
    if not reasons:
        return None
    parts = "; ".join(f"{reason} ({n})" for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"not tested here: {sum(reasons.values())} ({parts})"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """At the very end (after pytest's own summaries): the fault suite's and the bad-input suite's counts (and
    whether every case was handled), the seed of the run's random draws, and what the run could not test in this
    environment."""
    yield
    _suite_counts(terminalreporter)
    for line in (_seed_line(terminalreporter), untested_line(terminalreporter.stats)):
        if line:
            terminalreporter.write_line(line)


def _suite_counts(terminalreporter) -> None:
    faults = [r for key in ("passed", "failed") for r in terminalreporter.stats.get(key, [])
              if r.when == "call" and "fault" in r.keywords]
    if faults:
        survived = Counter(Path(r.nodeid.split("::")[0]).stem.removeprefix("test_") for r in faults if r.passed)
        per = _per(survived)
        lost = "no process left behind" if not LEFT_BEHIND else f"{len(LEFT_BEHIND)} process(es) LEFT BEHIND"
        terminalreporter.write_line(
            f"fault suite: {sum(survived.values())} of {len(faults)} faults survived or ended cleanly ({per}); {lost}")
    for line in LEFT_BEHIND:
        terminalreporter.write_line(f"  left behind (now killed): {line}")
    files, failed = _counted(terminalreporter, "tests.faults.test_fault_suite.FAULTS")
    if files:
        verdict = ("all handled (one line naming the file or variables)" if not failed
                   else f"{len(failed)} test(s) FAILED")
        terminalreporter.write_line(f"fault suite (files, variables): {sum(files.values())} cases tried "
                                    f"({_per(files)}); {verdict}")
    cases, failed = _counted(terminalreporter, "tests.fuzz.test_bad_input_suite.CASES")
    if not cases:
        return
    verdict = "all handled (exit 2, one line, nothing written)" if not failed else f"{len(failed)} command(s) FAILED"
    terminalreporter.write_line(f"bad-input suite: {sum(cases.values())} cases tried ({_per(cases)}); {verdict}")
    kinds, _ = _counted(terminalreporter, "tests.fuzz.test_bad_input_suite.KINDS")
    if kinds:
        terminalreporter.write_line(f"  by kind: {_per(kinds)}")


def logged_steps(run_dir: Path) -> list[int]:
    """The step of every record of a run's ``metrics.jsonl`` that logged one, in the file's order."""
    import json

    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip() and "step" in json.loads(line)]


def stopped_by_signal(folder: Path, argv: list[str], *, step: int, sig: int = signal.SIGTERM,
                      timeout: float = 180) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """``python -m multigpu ARGV callbacks=[...]`` whose rank 0 waits after ``step`` until ``sig``, sent to the
    launcher once it waits there (a pre-emption that lands at that step); the finished process, and the
    environment that lets the ranks import the callback (for a resumed run's ``callbacks``)."""
    (folder / "preempt_here.py").write_text(
        "from multigpu.testing.faults import WaitForSignal\n\n\n"
        f"def hook():\n    return WaitForSignal(rank=0, step={step}, ready={str(folder / 'ready')!r})\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "multigpu", *argv, "callbacks=[preempt_here:hook]"]
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while not (folder / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(args, proc.returncode, out, err), env
