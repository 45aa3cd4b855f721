"""The cluster tier: a real SLURM (Debian's slurmctld, slurmd, munge) on virtual hosts of this machine.

One cluster per pytest process (each xdist worker makes its own: its own bridge, addresses and daemons), made at the
first test that asks for it and removed at the end of the session (:mod:`tests.cluster.virtual`). A test that
breaks a host (kills it, cuts or slows its link, hides a folder) puts it back when it ends, failed or not.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.cluster import virtual
from tests.conftest import ROOT

TINY = ["model.kwargs.n_layer=1", "model.kwargs.n_head=2", "model.kwargs.n_embd=16", "block_size=16",
        "data.kwargs.max_chars=20000", "global_batch_size=8", "warmup_steps=1", "eval_every=0", "eval_batches=1",
        "log_every=1", "sample_chars=0", "prefetch=0", "logger=[]"]
"""A training job of a fraction of a second a step on 2 CPU ranks."""


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/cluster/" in str(item.fspath):
            item.add_marker(pytest.mark.cluster)
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def slurm():
    """This process's cluster: 4 hosts (node1..node4) and a controller. Skips, saying why, where none can be made
    (not root, Debian's packages missing: ``make test`` installs them as root)."""
    why = virtual.missing()
    if why:
        pytest.skip(why)
    virtual.sweep()
    # outside pytest's own base folder, which other pytest sessions on the machine prune while this one runs;
    # removed at the end unless MULTIGPU_KEEP_CLUSTER=1 (to read a failed job's files and the daemons' logs)
    root = Path(tempfile.mkdtemp(prefix="multigpu-cluster-", dir="/var/tmp"))
    cluster = virtual.SlurmCluster(root, nodes=4).up()
    try:
        yield cluster
    finally:
        cluster.down()
        if os.environ.get("MULTIGPU_KEEP_CLUSTER") != "1":
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"cluster kept: {root}")


@pytest.fixture
def hosts(slurm):
    """The cluster, with every host put back as it was made after the test (a test that broke one)."""
    yield slurm
    for host in slurm.hosts:
        try:
            slurm.heal(host)
        except Exception as exc:  # noqa: BLE001 - the next test would fail on it: say so
            pytest.fail(f"host {host.name} could not be put back: {exc}")
    # what the test left running is killed at once (a plain cancel waits KillWait for launchers that ignore a
    # second SIGTERM while they stop), then what is still pending is cancelled
    slurm.slurm("scancel", "-u", "root", "--full", "--signal=KILL", check=False)
    slurm.slurm("scancel", "-u", "root", check=False)
    deadline = time.monotonic() + 60
    while slurm.slurm("squeue", "-h", check=False).strip() and time.monotonic() < deadline:
        time.sleep(0.5)


def job_folder(cluster, name: str) -> Path:
    folder = cluster.shared / name
    folder.mkdir()
    return folder


def printed(cluster, folder: Path, name: str, *argv: str, env: dict | None = None) -> Path:
    """``multigpu ARGV --print-sbatch`` as a user types it on the login node (this machine, SLURM's commands on
    PATH), written to ``folder/name``; the script's path."""
    done = subprocess.run([sys.executable, "-m", "multigpu", *argv, "--print-sbatch"], cwd=folder,
                          env=cluster.env(**(env or {})), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    script = folder / name
    script.write_text(done.stdout)
    return script


def output(folder: Path, job_id: int) -> tuple[str, str]:
    """The job's .out and .err (as the generated script names them), "" where not written yet."""
    out = next(iter(folder.glob(f"*-{job_id}.out")), None)
    err = next(iter(folder.glob(f"*-{job_id}.err")), None)
    return (out.read_text(errors="replace") if out else "", err.read_text(errors="replace") if err else "")


def said(*parts) -> str:
    """An assertion's message made of a job's state and files, whole: pytest cuts the middle out of a tuple's
    repr, which is where a job's first start and its requeue are."""
    return "\n-----\n".join(part if isinstance(part, str) else repr(part) for part in parts)


def rank_logs(run: Path, tail: int = 1500) -> str:
    """The end of every rank's own stdout and stderr in a run folder (each start, each node), for a message: what a
    rank printed, whether or not its launcher's copy reached the job's .out file."""
    return "\n".join(f"{path.relative_to(run)}:\n{path.read_text(errors='replace')[-tail:]}"
                     for path in sorted(run.glob("logs/**/std*.log")))


def wait_for(path: Path, cluster, job_id: int, timeout: float) -> None:
    """Wait until ``path`` exists while the job runs (or is pending)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = cluster.job(job_id).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), said(state, *output(path.parent, job_id))
        assert time.monotonic() < deadline, (f"{path} not written within {timeout}s", output(path.parent, job_id))
        time.sleep(0.2)


def hook_module(folder: Path, name: str, body: str) -> dict[str, str]:
    """A callback module ``name`` in ``folder`` (which every host sees), and the environment that lets the job's
    ranks import it (sbatch passes the submitting environment to the job)."""
    (folder / f"{name}.py").write_text(body)
    return {"PYTHONPATH": f"{folder}:{ROOT / 'src'}"}


C10D_NOISE = re.compile(r"The hostname of the client socket cannot be retrieved")
"""torch's c10d line on hosts without reverse DNS (every rank, every connection)."""
