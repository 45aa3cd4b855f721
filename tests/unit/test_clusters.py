"""One class per cluster environment, read alike by the launcher and by the ranks (pure).

Before, SLURM was read in two places with two integer parsers: the launcher took ``SLURM_NODEID=1(x2)`` as 1 (it
cut any value at "("), the ranks refused it; the launcher read ``MASTER_PORT='²'`` as a digit and crashed.
"""

from __future__ import annotations

import pytest

from multigpu.errors import ConfigError
from multigpu.launch.schedulers import from_environment
from multigpu.runtime.clusters import (
    LSF,
    SLURM,
    ClusterEnvironment,
    Kubeflow,
    Local,
    OpenMPI,
    TorchElastic,
    node_environment,
    rank_environment,
)
from multigpu.runtime.env import read_placement

_SLURM = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "123456", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
          "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
          "SLURM_LOCALID": "0"}


def test_each_scheduler_is_one_class_that_detects_itself(tmp_path):
    rankfile = tmp_path / "ranks"
    rankfile.write_text("batch\nnodeA\nnodeB\n")
    found = {
        "slurm": node_environment(_SLURM),
        "pet": node_environment({"PET_NNODES": "2", "PET_MASTER_ADDR": "m"}),
        "lsf": node_environment({"LSB_JOBID": "7", "LSB_DJOB_RANKFILE": str(rankfile)}, hostname="nodeB"),
        "mpi": node_environment({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "MASTER_ADDR": "h"}),
    }
    assert [type(c) for c in found.values()] == [SLURM, Kubeflow, LSF, OpenMPI]
    assert [(c.nnodes(), c.node_rank()) for c in found.values()] == [(2, 1), (2, 0), (2, 1), (2, 1)]
    assert node_environment({}) is None and node_environment({"SLURM_JOB_ID": "1", "SLURM_NNODES": "2"}) is None
    assert type(rank_environment({"RANK": "0", "WORLD_SIZE": "1"})) is TorchElastic
    assert type(rank_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})) is SLURM
    assert type(rank_environment({})) is Local


def test_node_rank_is_the_launchers_question_and_group_rank_a_ranks():
    """One name for one meaning (#47): ``node_rank()`` is the launcher's question (which node the scheduler says
    this is: torchrun's ``--node-rank``); a rank asks ``group_rank()`` (its worker group's rank in the job as the
    rendezvous formed it: torchrun's ``GROUP_RANK``, which c10d hands out in join order). Before, the class had
    both ``node_rank()`` and ``rank_node()``."""
    torchrun = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    assert TorchElastic({**torchrun, "GROUP_RANK": "0"}).group_rank() == 0  # the rendezvous's, not 5 // 4
    assert TorchElastic(torchrun).group_rank() == 1  # without GROUP_RANK: rank // local_world_size
    assert read_placement({**torchrun, "GROUP_RANK": "0"}).node_rank == 0
    assert SLURM(_SLURM).group_rank() == SLURM(_SLURM).node_rank() == 1 and Local({}).group_rank() == 0
    assert not [c.__name__ for c in (ClusterEnvironment, TorchElastic, SLURM, Kubeflow, LSF, OpenMPI, Local)
                if hasattr(c, "rank_node")]


def test_the_launcher_and_the_ranks_read_slurm_through_the_same_class():
    launcher = from_environment(_SLURM)
    rank = read_placement(_SLURM)
    assert launcher.rdzv_endpoint == f"{rank.master_addr}:{rank.master_port}" == "gpu07:18456"
    assert launcher.node_rank == rank.node_rank == 1 and launcher.nnodes == rank.world_size == 2
    for name, value in [("SLURM_NODEID", "1(x2)"), ("MASTER_PORT", "\u00b2"), ("SLURM_JOB_NODELIST", "gpu[8-7]")]:
        env = {**_SLURM, name: value}
        with pytest.raises(ConfigError) as launcher_says:
            from_environment(env)
        with pytest.raises(ConfigError) as rank_says:
            read_placement(env)
        assert str(launcher_says.value) == str(rank_says.value) and name in str(rank_says.value)
    # SLURM's own count form is read where SLURM writes it, on both sides
    assert from_environment({**_SLURM, "SLURM_NTASKS_PER_NODE": "1(x2)"}).nnodes == 2
    assert read_placement({**_SLURM, "SLURM_NTASKS_PER_NODE": "1(x2)"}).local_world_size == 1
