"""Moving a torchrun, accelerate or Lightning Fabric script over, step by step, as the migration page
walks it (tier 3: the real launcher, real ranks). Each test is one step of the page, run on a stand-in of the
script's shape in tests/scripts: ddp_tutorial.py (pytorch/examples' DDP tutorial), accelerate_train.py with an
`accelerate config` file, fabric_train.py. nanoGPT's own files: test_nanogpt_e2e.py; pytorch/examples' imagenet:
test_imagenet_e2e.py."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_launch_aliases import ACCELERATE_CONFIG
from tests.conftest import SCRIPTS, run_cli

pytestmark = pytest.mark.e2e

TUTORIAL = str(SCRIPTS / "ddp_tutorial.py")


def _ranks(stdout: str) -> list[dict]:
    """Each rank's JSON line, by rank."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(lines, key=lambda d: d["rank"])


def test_torchrun_step_1_a_script_that_asks_for_nccl_on_cpu_ranks_gets_a_hint():
    proc = run_cli("launch", "--nproc-per-node", "1", TUTORIAL, "1", "1", "--variant", "nccl")
    assert proc.returncode == 1
    assert "RuntimeError: Distributed package doesn't have NCCL built in" in proc.stderr
    assert ("hint: the script asks for NCCL, and this rank runs on the CPU (gloo): call init_process_group() "
            "without backend=") in proc.stderr, proc.stderr


def test_torchrun_step_2a_only_the_device_lines_changed_runs_on_two_ranks():
    """``init_process_group("gloo")`` kept, ``torch.cuda.set_device`` -> ``mg.device()`` with no ``mg.init()``."""
    proc = run_cli("launch", "--nproc-per-node", "2", TUTORIAL, "2", "1", "--variant", "device-only")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(proc.stdout)
    assert [r["world_size"] for r in ranks] == [2, 2]
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(64))  # the sampler split the data
    assert ranks[0]["weight"] == ranks[1]["weight"]  # DDP kept the replicas equal


def test_torchrun_step_2b_init_process_group_replaced_by_mg_init_benches_at_one_and_two_ranks(tmp_path):
    """bench's 1-rank baseline: ``mg.init()`` at world size 1 gives torch's group of one, so the script's
    DistributedSampler works as under torchrun with one process."""
    proc = run_cli("bench", "--nproc", "1,2", "-o", str(tmp_path / "b"), TUTORIAL, "2", "1", "--variant", "mg-init",
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(proc.stdout)
    one = [r for r in ranks if r["world_size"] == 1]
    two = [r for r in ranks if r["world_size"] == 2]
    assert [sorted(r["seen"]) for r in one] == [list(range(64))]  # one rank: every sample
    assert len(two) == 2 and sorted(two[0]["seen"] + two[1]["seen"]) == list(range(64))
    assert [r["world_size"] for r in json.loads((tmp_path / "b" / "bench.json").read_text())["rows"]] == [1, 2]


def test_accelerate_an_accelerate_config_file_launches_its_processes_and_precision(tmp_path):
    config = tmp_path / "default_config.yaml"
    config.write_text(ACCELERATE_CONFIG)
    proc = run_cli("launch", "--config_file", str(config), str(SCRIPTS / "accelerate_train.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"accelerate config {config}: taken: distributed_type MULTI_CPU (--cpu), mixed_precision bf16" in proc.stderr
    ranks = _ranks(proc.stdout)
    assert [(r["num_processes"], r["mixed_precision"]) for r in ranks] == [(2, "bf16")] * 2
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == [0, 4, 8, 12, 16, 20, 24, 28] and ranks[0]["weights_equal"]


def test_fabric_a_script_with_devices_auto_runs_as_one_job_on_cpu_ranks():
    """Fabric counts one CPU device for devices='auto'; on CPU ranks it is the processes per node here."""
    pytest.importorskip("lightning_fabric")
    proc = run_cli("launch", "--nproc-per-node", "2", str(SCRIPTS / "fabric_train.py"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _ranks(proc.stdout)
    assert [(r["rank"], r["world_size"]) for r in ranks] == [(0, 2), (1, 2)]
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(8)) and all(r["weights_equal"] for r in ranks)
    assert "never joined a process group" not in proc.stderr
