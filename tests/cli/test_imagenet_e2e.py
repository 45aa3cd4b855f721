"""pytorch/examples' imagenet ``main.py`` (tests/third_party/imagenet, the real file) under ``multigpu launch``, as a
user brings it: a script from before torchrun that spawns its own workers (``--multiprocessing-distributed``), and
that, without that flag, trains alone on every rank unless told ``--dist-url env://``.

These pin the contract of docs/migration/torchrun.md's "pytorch/examples' imagenet" section: spawned workers end the
job with one line saying what to change (they waited 30 minutes for a store nobody serves: a silent hang), a rank
that trains with no process group is told at its first step (2 copies ran 160,146 steps each before a user noticed),
and the edits the page shows make it one job. torchvision does not import on this machine's CPU torch (its PyPI
wheels are built for CUDA torch), so ``main.py`` runs unchanged against ``tests/scripts/torchvision_standin``.
"""

from __future__ import annotations

import re
import socket
import time

import pytest
import torch

from tests import guide_edits
from tests.conftest import ROOT, SCRIPTS, run_cli

pytestmark = pytest.mark.e2e

MAIN = ROOT / "tests" / "third_party" / "imagenet" / "main.py"
GUIDE = ROOT / "docs" / "migration" / "torchrun.md"
TINY = ["--dummy", "-j", "0", "--epochs", "1", "-b", "4", "-p", "1"]
"""Fake data, no loader processes, one epoch of 16 images (the stand-in's FakeData) in batches of 4."""
ENV = {"PYTHONPATH": str(SCRIPTS / "torchvision_standin"), "OMP_NUM_THREADS": "1"}


def _launch(cwd, *args: str, timeout: float = 120):
    return run_cli("launch", "--nproc-per-node", "2", str(cwd / "main.py"), *TINY, *args, env=ENV, cwd=cwd,
                   timeout=timeout)


@pytest.fixture
def imagenet(tmp_path):
    """A folder holding the real main.py, as a user's clone would (it writes checkpoint.pth.tar beside it)."""
    (tmp_path / "main.py").write_text(MAIN.read_text())
    return tmp_path


def test_imagenet_spawning_its_own_workers_under_launch_ends_with_one_line_not_a_hang(imagenet):
    """The README's single-node command, under multigpu launch. Each spawned worker inherits the launcher's
    environment (TORCHELASTIC_USE_AGENT_STORE), so its tcp:// init waits as a client for a store nobody serves:
    the job stood still until Ctrl-C. Now each rank ends within seconds, naming mp.spawn and the flags to use."""
    with socket.socket() as held:  # the --dist-url's port, held by the test: nobody else gets it meanwhile
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        started = time.monotonic()
        proc = _launch(imagenet, "--dist-url", f"tcp://127.0.0.1:{port}", "--dist-backend", "gloo",
                       "--multiprocessing-distributed", "--world-size", "1", "--rank", "0", timeout=90)
    took = time.monotonic() - started
    assert proc.returncode == 1, proc.stderr
    assert took < 60, took
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("error: rank"))
    assert "torch.multiprocessing.spawn" in line and "--multiprocessing-distributed" in line, line
    assert "--dist-url env://" in line, line


def test_imagenet_without_its_flags_trains_alone_on_each_rank_and_is_told_at_its_first_step(imagenet):
    """Without --multiprocessing-distributed (and with the default --dist-url), main.py never joins a group: each
    rank trains its own model on all the data. The launcher said so only when the job ended; rank 0 now says so at
    its first optimizer step, before the first epoch's end (the end's line stays)."""
    proc = _launch(imagenet)
    assert proc.returncode == 0, proc.stderr
    early = [ln for ln in proc.stderr.splitlines() if "steps an optimizer with no process group" in ln]
    assert len(early) == 1, proc.stderr
    assert "2 ranks each train their own copy" in early[0] and "--dist-url env://" in early[0], early[0]
    assert "never joined a process group" in proc.stderr, proc.stderr


def test_imagenet_edited_as_the_guide_shows_trains_as_one_job_of_two_ranks(imagenet):
    """The page's edits (DDP on CPU ranks too; rank 0 saves) and its command (--dist-url env://): one job, the
    model wrapped in DDP on both ranks, no warning, one checkpoint written by rank 0."""
    guide_edits.apply(imagenet / "main.py", GUIDE, "imagenet")
    proc = _launch(imagenet, "--dist-url", "env://", "--dist-backend", "gloo")
    assert proc.returncode == 0, proc.stderr
    assert "warning" not in proc.stderr, proc.stderr
    summaries = re.findall(r"^ \* +Acc@1 \S+ Acc@5 \S+$", proc.stdout, re.M)  # each rank's, all-reduced: alike
    assert len(summaries) == 2 and summaries[0] == summaries[1], proc.stdout
    saved = torch.load(imagenet / "checkpoint.pth.tar", weights_only=False)
    assert all(key.startswith("module.") for key in saved["state_dict"]), list(saved["state_dict"])[:3]  # DDP's


def test_spawned_helpers_that_join_no_group_run_and_a_group_of_one_is_told(tmp_path):
    """No false alarm: workers a rank spawns that join no process group run as before. A rank that makes a
    process group of one in a job of 2 ranks (every rank then trains alone) is told once, when it makes it; its
    optimizer steps in that group raise no second line."""
    proc = run_cli("launch", "--nproc-per-node", "2", str(SCRIPTS / "spawn_helpers.py"), str(tmp_path),
                   env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "helper0").read_text() == "45"
    told = [ln for ln in proc.stderr.splitlines() if "warning: rank 0 made a process group of one rank" in ln]
    assert len(told) == 1 and "in a job of 2 ranks" in told[0], proc.stderr
    assert "no process group" not in proc.stderr, proc.stderr
