"""Every worker's random generators start as a new interpreter's do under torchrun (issue 48, critical 1).

Workers forked from the launcher's fork server (multigpu.launch.forkserver) shared its torch default generator: every
rank of a node drew the same "random" batches, augmentations and dropout masks. These run the same two-rank script
under ``python -m torch.distributed.run`` and under ``multigpu launch`` and compare what each generator draws."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy
import pytest
import torch

from tests.conftest import ROOT, SCRIPTS, run_cli

pytestmark = pytest.mark.e2e

SCRIPT = str(SCRIPTS / "rng_draws.py")
GENERATORS = ("torch_initial_seed", "torch", "random", "numpy_legacy", "numpy_default_rng")
"""What the script draws from: torch's CPU default generator (its seed and three draws), Python's ``random``,
NumPy's legacy global generator and a ``numpy.random.default_rng()`` made without a seed."""


def _draws(proc: subprocess.CompletedProcess, folder) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_each_rank_draws_its_own_random_numbers_as_under_torchrun_and_a_seed_still_makes_them_reproducible(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONHASHSEED", None)
    (tmp_path / "torchrun").mkdir()
    torchrun = _draws(subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                      "--nproc-per-node", "2", SCRIPT, str(tmp_path / "torchrun")],
                                     capture_output=True, text=True, timeout=180, cwd=ROOT, env=env),
                      tmp_path / "torchrun")
    (tmp_path / "ours").mkdir()
    ours = _draws(run_cli("launch", "--nproc-per-node", "2", "--threads", "1", SCRIPT, str(tmp_path / "ours"),
                          env={"PYTHONHASHSEED": "random"}), tmp_path / "ours")
    for name in GENERATORS:
        assert torchrun[0][name] != torchrun[1][name], name  # a new interpreter per rank: each its own stream
        assert ours[0][name] != ours[1][name], (name, ours)  # was: torch's the same on every rank
    # no device seed waits for CUDA's start in a rank that set none (torch seeds CUDA's generators from the OS then)
    assert [d["queued_device_seeds"] for d in torchrun + ours] == [[]] * 4
    # the string hash seed: each process's own under torchrun (PYTHONHASHSEED unset); a forked worker keeps the one
    # its launcher drew, the same on every rank of the node (docs/launching.md says so)
    assert torchrun[0]["hash"] != torchrun[1]["hash"]
    assert ours[0]["hash"] == ours[1]["hash"]

    # the documented way to reproducible draws, mg.init(seed=7): every rank the same stream, the same as seeding here
    (tmp_path / "seeded").mkdir()
    seeded = _draws(run_cli("launch", "--nproc-per-node", "2", "--threads", "1", SCRIPT, str(tmp_path / "seeded"), "7",
                            env={"PYTHONHASHSEED": "0"}), tmp_path / "seeded")
    expected = {"torch_initial_seed": 7,
                "torch": torch.randint(0, 10**9, (3,), generator=torch.Generator().manual_seed(7)).tolist(),
                "random": random.Random(7).random(), "numpy_legacy": float(numpy.random.RandomState(7).rand())}
    for rank in (0, 1):
        assert {k: seeded[rank][k] for k in expected} == expected, rank
    # an explicit PYTHONHASHSEED reaches every rank, as under torchrun
    fixed = subprocess.run([sys.executable, "-c", "print(hash('the string hash seed'))"], capture_output=True,
                           text=True, env={**env, "PYTHONHASHSEED": "0"}, check=True).stdout.strip()
    assert seeded[0]["hash"] == seeded[1]["hash"] == int(fixed)
