"""The node's place in a job, read from SLURM, PET_* (Kubeflow PyTorchJob), LSF and Open MPI (pure)."""

from __future__ import annotations

import pytest

from multigpu.errors import ConfigError
from multigpu.launch.schedulers import SchedulerPlacement, from_environment


def test_no_scheduler_and_an_sbatch_shell_without_srun_say_nothing():
    assert from_environment({}) is None
    assert from_environment({"SLURM_JOB_ID": "42", "SLURM_NNODES": "2", "SLURM_NODEID": "0"}) is None


def test_slurm_step_gives_nodes_rank_first_host_and_a_port_from_the_job_id():
    env = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
           "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_NTASKS_PER_NODE": "1", "SLURM_GPUS_ON_NODE": "8"}
    p = from_environment(env)
    assert p == SchedulerPlacement("SLURM", 4, 2, "gpu07:18456", 8)  # 15000 + 3456 % 20000
    assert from_environment({**env, "MASTER_PORT": "29400"}).rdzv_endpoint == "gpu07:29400"
    assert from_environment({**env, "SLURM_GPUS_ON_NODE": "", "SLURM_GPUS_PER_NODE": "h100:4"}).nproc_per_node == 4
    with pytest.raises(ConfigError, match="starts 8 tasks per node .*--ntasks-per-node=1"):
        from_environment({**env, "SLURM_NTASKS_PER_NODE": "8"})
    with pytest.raises(ConfigError, match="SLURM_NODEID='x' must be a whole number"):
        from_environment({**env, "SLURM_NODEID": "x"})


def test_pet_variables_as_kubeflow_sets_them():
    env = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0", "PET_MASTER_PORT": "23456",
           "PET_NPROC_PER_NODE": "4"}
    assert from_environment(env) == SchedulerPlacement("PET_* (Kubeflow PyTorchJob / torchrun)", 2, 1,
                                                       "job-master-0:23456", 4)
    assert from_environment({**env, "PET_RDZV_ENDPOINT": "etcd:2379"}).rdzv_endpoint == "etcd:2379"


def test_lsf_rank_file_without_its_launch_node(tmp_path):
    rankfile = tmp_path / "ranks"
    rankfile.write_text("batch1\nnodeA\nnodeA\nnodeB\nnodeB\n")
    env = {"LSB_JOBID": "777", "LSB_DJOB_RANKFILE": str(rankfile)}
    assert from_environment(env, hostname="nodeB") == SchedulerPlacement("LSF", 2, 1, "nodeA:15777")
    with pytest.raises(ConfigError, match=r"this host \(login3\) is not in LSF's rank file"):
        from_environment(env, hostname="login3")


def test_open_mpi_needs_a_master_address():
    env = {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2"}
    with pytest.raises(ConfigError, match="set MASTER_ADDR .* or pass --rdzv-endpoint"):
        from_environment(env)
    assert from_environment({**env, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "6000"}) == \
        SchedulerPlacement("Open MPI", 3, 2, "10.1.1.1:6000")
