"""The launcher on real CUDA: --gpus all, --isolate-devices, hybrid jobs, ranks sharing a GPU, NCCL's refusal.

Each test launches tests/scripts/gpu_ranks.py through `multigpu launch` (tier 3)
and reads what every rank saw: its device, the process-group backend, the four
visible-device variables, its GPU's UUID, and the result of an all-reduce and
a gather on its device. Skipped (with the reason) where CUDA is missing.
"""

from __future__ import annotations

import json

import pytest
import torch

from multigpu.testing import requires_backend, requires_gpus
from tests.conftest import SCRIPTS, run_cli

pytestmark = pytest.mark.e2e
SCRIPT = str(SCRIPTS / "gpu_ranks.py")
VARIABLES = ("CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE", "EGL_DEVICE_ID")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _ranks(out, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def _all_reduce_and_gather_agree(ranks: list[dict]) -> None:
    n = len(ranks)
    total = n * (n + 1) / 2  # every rank added rank + 1
    assert all(r["sum"] == [total] * 4 for r in ranks), [r["sum"] for r in ranks]
    assert ranks[0]["gathered"] == [float(r) for r in range(n) for _ in range(r + 1)]


@requires_gpus(1)
def test_gpus_all_runs_one_rank_per_gpu_on_nccl(tmp_path):
    proc = run_cli("launch", "--gpus", "all", SCRIPT, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    n = _gpus()
    ranks = _ranks(tmp_path, n)
    assert [r["device"] for r in ranks] == [f"cuda:{i}" for i in range(n)]
    assert {r["backend"] for r in ranks} == ({"nccl"} if n > 1 else {"none"})
    assert len({r["uuid"] for r in ranks}) == n  # one GPU each
    _all_reduce_and_gather_agree(ranks)


@requires_gpus(1)
def test_isolate_devices_pins_each_worker_to_its_gpu_as_cuda0(tmp_path):
    proc = run_cli("launch", "--gpus", "all", "--isolate-devices", SCRIPT, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    ranks = _ranks(tmp_path, _gpus())
    for i, r in enumerate(ranks):
        assert r["device"] == "cuda:0" and r["cuda_count"] == 1
        values = {r[k] for k in VARIABLES}
        assert len(values) == 1 and None not in values, {k: r[k] for k in VARIABLES}  # the four agree
        assert r["uuid"] == str(torch.cuda.get_device_properties(i).uuid)  # and name this launcher's GPU i
    _all_reduce_and_gather_agree(ranks)


@requires_gpus(1)
def test_hybrid_job_runs_a_gpu_rank_and_a_cpu_rank_on_gloo(tmp_path):
    proc = run_cli("launch", "--gpus", "1", "--nproc-per-node", "2", "--allow-cpu-ranks", SCRIPT, str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    ranks = _ranks(tmp_path, 2)
    assert [r["device"] for r in ranks] == ["cuda:0", "cpu"] and {r["backend"] for r in ranks} == {"gloo"}
    assert "hybrid job" in proc.stderr
    _all_reduce_and_gather_agree(ranks)


@requires_gpus(1)
def test_two_ranks_on_one_gpu_error_out_or_share_it_over_gloo(tmp_path):
    """With NCCL: one line naming the choices, before any rank starts. With --share-gpus: shared over gloo."""
    refused = run_cli("launch", "--gpus", "1", "--nproc-per-node", "2", SCRIPT, str(tmp_path))
    err = refused.stderr.strip()
    assert refused.returncode == 2 and err.count("\n") == 0 and "NCCL allows one rank per GPU" in err, err
    assert not list(tmp_path.glob("rank*.json"))

    shared = run_cli("launch", "--gpus", "1", "--nproc-per-node", "2", "--share-gpus", SCRIPT, str(tmp_path))
    assert shared.returncode == 0, shared.stderr
    ranks = _ranks(tmp_path, 2)
    assert [r["device"] for r in ranks] == ["cuda:0", "cuda:0"] and {r["backend"] for r in ranks} == {"gloo"}
    assert ranks[0]["uuid"] == ranks[1]["uuid"] == str(torch.cuda.get_device_properties(0).uuid)
    assert "ranks share 1 GPU(s)" in shared.stderr
    _all_reduce_and_gather_agree(ranks)


@requires_gpus(1)
@requires_backend("nccl")
def test_nccl_forced_onto_a_shared_gpu_ends_with_one_line_of_advice(tmp_path):
    """A rank that asks NCCL for a GPU another rank holds gets our advice, not NCCL's internals (or NCCL copes)."""
    proc = run_cli("launch", "--gpus", "1", "--nproc-per-node", "2", "--share-gpus", "--timeout-s", "60", SCRIPT,
                   str(tmp_path), "--force-nccl")
    if proc.returncode == 0:  # a newer NCCL that allows it: then the collectives must still be right
        _all_reduce_and_gather_agree(_ranks(tmp_path, 2))
        return
    first = next(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert "NCCL refused rank" in first and "--share-gpus" in first, proc.stderr[-3000:]
