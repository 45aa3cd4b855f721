"""Two launchers on loopback configured only by a scheduler's environment form one 2-node job.

Before, `multigpu launch` under `srun` or a Kubeflow PyTorchJob ignored SLURM_* and PET_* and ran each node as a
job of its own (nnodes 1). The test holds the rendezvous store itself (is_host=false), as test_launch_e2e's
two-node test does, so no port is chosen by hand.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def _node_env(kind: str, node_rank: int, port: int) -> dict[str, str]:
    if kind == "slurm":
        return {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": str(node_rank),
                "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NTASKS_PER_NODE": "1", "MASTER_PORT": str(port)}
    return {"PET_NNODES": "2", "PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port), "PET_NPROC_PER_NODE": "1"}


@pytest.mark.parametrize("kind", ["slurm", "pet"])
def test_two_nodes_from_the_schedulers_variables_alone(kind):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # we keep the socket
    argv = [sys.executable, "-m", "multigpu", "launch", "--rdzv-conf", "is_host=false", "examples/hello.py"]
    secret = {"MULTIGPU_RDZV_SECRET": "0123456789abcdef0123"}  # what every node of a multi-node job shares
    procs = [subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **secret,
                                                   **_node_env(kind, r, store.port)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    joined = "".join(o for o, _ in outs)
    assert "rank 0/2 on cpu" in joined and "rank 1/2 on cpu" in joined
    assert "gathered on rank 0: [1, 4, 9, 16, 25, 36, 49, 64, 81, 100]" in joined


def test_a_flag_that_contradicts_the_scheduler_is_one_line():
    env = {**os.environ, **_node_env("slurm", 1, 29400)}
    proc = subprocess.run([sys.executable, "-m", "multigpu", "launch", "--nnodes", "4", "examples/hello.py"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --nnodes 4 contradicts SLURM, which says 2 for this node; drop --nnodes or run outside the "
        "scheduler's step"]


def test_print_sbatch_and_k8s_give_a_job_file_for_this_command_without_node_flags(capsys):
    import yaml

    from multigpu.cli import main

    assert main(["launch", "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "h:1", "--nproc-per-node", "4",
                 "--print-sbatch", "examples/hello.py", "--x", "1"]) == 0
    script = capsys.readouterr().out.splitlines()
    assert script[0] == "#!/bin/bash" and "#SBATCH --nodes=2" in script and "#SBATCH --job-name=multigpu-hello" in script
    assert "#SBATCH --ntasks-per-node=1" in script[3] and script[4].startswith("#SBATCH --gpus-per-node=4")
    assert script[-1] == "srun multigpu launch --nproc-per-node 4 examples/hello.py --x 1"  # the node flags: SLURM's
    assert main(["train", "-f", "nano", "--nnodes=3", "--gpus", "0,1", "--print_k8s", "steps=10"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    assert (job["kind"], job["spec"]["nprocPerNode"]) == ("PyTorchJob", "2")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["multigpu", "train", "-f", "nano", "--gpus", "0,1", "steps=10"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert main(["launch", "--print-sbatch", "--print-k8s", "examples/hello.py"]) == 2
