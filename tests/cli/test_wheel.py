"""A normal (non-editable) install works: the wheel, installed into a fresh venv, runs every command.

Nothing may read the repository: the presets ship inside the package, the
built-in workloads need no ``configs/`` folder, and the commands run from a
folder that is not the checkout. The fresh venv borrows the dependencies
(torch, numpy, ...) of the test's own environment through a ``.pth`` file, so
nothing is downloaded; multigpu itself comes only from the wheel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

COMMANDS = ["launch", "info", "train", "sim", "infer", "rl", "run", "bench", "verify", "doctor", "report"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp / "dist"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next((tmp / "dist").glob("multigpu-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                              str(wheel)], capture_output=True, text=True, timeout=300, env=clean)
    assert install.returncode == 0, install.stderr[-3000:]
    # only now borrow the dependencies: pip would have taken this checkout's editable install for the wheel
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    assert (site / "multigpu" / "presets" / "nano.yaml").is_file()
    assert (site / "multigpu" / "plan" / "catalog.yaml").is_file()  # multigpu plan's hardware catalog
    (site / "_borrowed_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "work"
    work.mkdir()
    return venv, work


def _run(venv: Path, work: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([str(venv / "bin" / "multigpu"), *args], capture_output=True, text=True, cwd=work,
                          env=env, timeout=timeout)


def test_the_wheel_is_what_runs_and_every_command_has_help(installed):
    venv, work = installed
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import multigpu; print(multigpu.__file__)"],
                           capture_output=True, text=True, cwd=work, env={**os.environ, "PYTHONPATH": ""})
    assert where.stdout.strip().startswith(str(venv)), where.stdout + where.stderr
    top = _run(venv, work, "--help")  # the console script itself
    assert top.returncode == 0 and all(c in top.stdout for c in COMMANDS), top.stdout + top.stderr
    every = ("import contextlib, io, sys\nfrom multigpu.cli import main\n"  # one process: one torch import
             f"for c in {COMMANDS!r}:\n"
             "    out = io.StringIO()\n"
             "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
             "        main([c, '--help'])\n"
             "    assert out.getvalue().startswith('usage: multigpu ' + c), (c, out.getvalue()[:200])\n"
             "print('help ok')\n")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", every], capture_output=True, text=True, cwd=work,
                          env={**os.environ, "PYTHONPATH": ""}, timeout=120)
    assert proc.returncode == 0 and "help ok" in proc.stdout, proc.stderr[-3000:]


def test_the_wheel_runs_each_workload_and_bench_and_verify(installed):
    venv, work = installed
    runs = work / "runs"
    cases = {
        "train": ["train", "-f", "nano", "steps=2", "batch_size=2", "eval_every=0",
                  "model.kwargs.n_layer=1", "model.kwargs.n_embd=32", "model.kwargs.n_head=2", "block_size=16",
                  "data.kwargs.max_chars=20000", "sample_chars=8", "checkpoint_every=0"],
        "infer": ["infer", "--roi", "128", "--batch-size", "8"],
        "rl": ["rl", "-f", "ppo-cartpole", "num_envs=16", "num_steps=8", "total_env_steps=256", "target_return=null"],
    }
    for name, argv in cases.items():
        proc = _run(venv, work, *argv, "--run-dir", str(runs / name))
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        assert json.loads((runs / name / "summary.json").read_text())["world_size"] >= 1, name
    assert (runs / "infer" / "out" / "demo_input.png").stat().st_size > 1000  # the demo photo, denoised
    bench = _run(venv, work, "bench", "--nproc", "1,2", "-o", str(runs / "bench"), "sim", "agents=4000", "steps=3",
                 "grid=[20,20]")
    assert bench.returncode == 0, bench.stderr[-3000:]
    assert [r["world_size"] for r in json.loads((runs / "bench" / "bench.json").read_text())["rows"]] == [1, 2]
    script = work / "same.py"
    script.write_text("import multigpu as mg\nmg.init()\nmg.verify.record('n', mg.gather(list(mg.shard(range(10)))))\n"
                      "mg.shutdown()\n")
    verify = _run(venv, work, "verify", "--nproc", "1,2", str(script))
    assert verify.returncode == 0 and "verify passed" in verify.stdout, verify.stderr[-3000:]
