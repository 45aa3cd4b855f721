"""Shared fixtures: a clean runtime and environment around every test, a one-rank group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts"

# Variables the launcher and init() may set; a test that leaks one fails.
_WATCHED_PREFIXES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_", "GROUP_RANK",
                     "MULTIGPU_", "CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE",
                     "EGL_DEVICE_ID", "OMP_NUM_THREADS", "TORCHELASTIC_")


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
    ``available_bytes`` makes up this node's free memory (None: unknown, so no memory check)."""
    from multigpu.launch.devices import HostFacts

    def install(count: int, visible: str | None = None, cores: int = 2, available_bytes: int | None = None) -> HostFacts:
        facts = HostFacts(gpu_count=count, visible=visible, cores=cores, available_bytes=available_bytes)
        monkeypatch.setattr(HostFacts, "probe", classmethod(lambda cls: facts))
        return facts

    return install


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


def pytest_terminal_summary(terminalreporter):
    """Print the bad-input and fault suites' counts of cases (and whether every one was handled)."""
    import sys

    for module, counter, name, handled in [
        ("tests.fuzz.test_bad_input_suite", "CASES", "bad-input suite", "exit 2, one line, nothing written"),
        ("tests.faults.test_fault_suite", "FAULTS", "fault suite", "one line naming the file or variables"),
    ]:
        suite = sys.modules.get(module)
        cases = getattr(suite, counter, None)
        if not cases:
            continue
        failed = [r for r in terminalreporter.stats.get("failed", []) if module.rsplit(".", 1)[1] in r.nodeid]
        per = ", ".join(f"{k} {v}" for k, v in sorted(cases.items()))
        verdict = f"all handled ({handled})" if not failed else f"{len(failed)} test(s) FAILED"
        terminalreporter.write_line(f"{name}: {sum(cases.values())} cases tried ({per}); {verdict}")
