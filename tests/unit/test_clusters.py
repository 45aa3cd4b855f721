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
