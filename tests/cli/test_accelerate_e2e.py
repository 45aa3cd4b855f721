"""Scripts written for accelerate run as ONE job under `multigpu launch`, and N copies are named as such.

accelerate forms one job of CPU ranks only with ACCELERATE_USE_CPU (its launcher's --cpu), and its
PartialState ignores even that: before, accelerate's own test scripts "passed" under our launcher as two
independent single-process copies (`Num processes: 1`, `DistributedType.NO` on both ranks), each on all
the data, exit 0. These tests run accelerate's own scripts (shipped in the package) on 2 CPU ranks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, run_cli

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.e2e
ACCELERATE_SCRIPTS = Path(accelerate.__file__).parent / "test_utils" / "scripts"
COPIES = "never joined a process group: your script ran as 2 independent copies"


@pytest.mark.parametrize("script,shows", [
    ("test_ops.py", "Num processes: 2"),
    ("test_sync.py", "**Test Distributed `no_sync` context manager**"),
    ("test_script.py", "Num processes: 2"),
])
def test_accelerates_own_test_scripts_run_as_one_two_process_job(script, shows):
    proc = run_cli("launch", "--nproc-per-node", "2", str(ACCELERATE_SCRIPTS / script),
                   env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert shows in out and "Num processes: 1" not in out and "DistributedType.NO" not in out, out[-3000:]
    assert COPIES not in proc.stderr


def test_a_plain_accelerate_training_script_shards_its_data_over_two_ranks():
    proc = run_cli("launch", "--nproc-per-node", "2", "--mixed_precision", "bf16", str(SCRIPTS / "accelerate_train.py"),
                   env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                   key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["num_processes"] == 2 and r["distributed_type"] == "DistributedType.MULTI_CPU" and r["ranks"] == [0, 1]
        assert r["weights_equal"] and r["mixed_precision"] == "bf16"
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == list(range(0, 32, 4))  # every sample once, split
    assert ranks[0]["seen"] and ranks[1]["seen"]


def test_a_script_that_never_joins_a_group_is_named_as_copies_and_bench_verify_refuse_it(tmp_path):
    script = str(SCRIPTS / "no_group.py")
    proc = run_cli("launch", "--nproc-per-node", "2", script, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("did its work alone") == 2
    assert proc.stderr.strip().splitlines()[-1] == f"multigpu: warning: rank 0 and rank 1 {COPIES}. Call mg.init() " \
        "(or torch.distributed.init_process_group) in the script; an accelerate script on CPU ranks needs " \
        "Accelerator(cpu=True) or PartialState(cpu=True); a Lightning Fabric script needs " \
        "Fabric(devices=int(os.environ['LOCAL_WORLD_SIZE'])), the processes started on each node"
    for command in (["bench", "--nproc", "2", "-o", str(tmp_path / "bench")],
                    ["verify", "--nproc", "1,2", "-o", str(tmp_path / "verify")]):
        proc = run_cli(*command, script, timeout=240)
        assert proc.returncode == 1, (command, proc.stdout[-2000:], proc.stderr[-2000:])
        assert proc.stderr.strip().splitlines()[-1].startswith(f"error: rank 0 and rank 1 {COPIES}"), proc.stderr[-2000:]
        assert "speedup" not in proc.stdout.lower()
