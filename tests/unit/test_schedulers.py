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


_STEP = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
         "SLURM_NTASKS_PER_NODE": "1"}


@pytest.mark.parametrize("nodelist,host", [
    ("gpu[1-2]-ib", "gpu1-ib"),                # text after a bracket group
    ("rack[1-2]-n[01-02]", "rack1-n01"),       # two groups
    ("n[0-999999999]", "n0"),                  # a billion hosts: only the first is read, nothing is expanded
])
def test_the_rendezvous_host_is_the_first_of_the_whole_host_list_grammar(nodelist, host):
    placement = from_environment({**_STEP, "SLURM_JOB_NODELIST": nodelist, "MASTER_PORT": "29400"})
    assert placement.rdzv_endpoint == f"{host}:29400"
    env = {k: v for k, v in _STEP.items() if k != "SLURM_NNODES"}
    assert from_environment({**env, "SLURM_JOB_NODELIST": "n[0-999999999]"}).nnodes == 1_000_000_000


@pytest.mark.parametrize("env,needle", [
    ({"SLURM_JOB_NODELIST": "node[5-3]"}, "SLURM_JOB_NODELIST='node[5-3]' is not a SLURM host list: the range 5-3"),
    ({"SLURM_JOB_NODELIST": "node[a-b]"}, "SLURM_JOB_NODELIST='node[a-b]' is not a SLURM host list"),
    ({"SLURM_JOB_NODELIST": "localhost[1-2"}, "SLURM_JOB_NODELIST='localhost[1-2' is not a SLURM host list"),
    ({"SLURM_JOB_NODELIST": "n1", "MASTER_PORT": "\u00b2"}, "MASTER_PORT='\u00b2' must be a whole number"),
    ({"SLURM_JOB_NODELIST": "n1", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range; valid: 0 to 65535"),
    ({"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "\u00b2"}, "SLURM_GPUS_ON_NODE='\u00b2' must be a whole"),
    ({"SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "4(x2)"}, "SLURM_NODEID='4(x2)' must be a whole number"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m", "PET_NPROC_PER_NODE": "\u00b2"},
     "PET_NPROC_PER_NODE='\u00b2' must be a whole number"),
    ({"PET_NNODES": "2", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "\u0664"}, "PET_MASTER_PORT='\u0664' must be"),
])
def test_a_bad_scheduler_variable_is_one_line_naming_it(env, needle, monkeypatch, capsys):
    """Before: 'internal error: ValueError' ('²' passes str.isdigit but not int), or a blame of the endpoint."""
    from multigpu.cli import main

    for name in list(__import__("os").environ):
        if name.startswith(("SLURM_", "PET_", "LSB_", "OMPI_", "MASTER_")):
            monkeypatch.delenv(name)
    base = _STEP if "PET_NNODES" not in env else {}
    for name, value in {**base, **env}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MULTIGPU_RDZV_SECRET", "0123456789abcdef0123")
    assert main(["launch", "examples/hello.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: environment variable " if "NODELIST" not in needle else "error: ") and needle in err
    assert err.count("\n") == 1, err


def test_an_lsf_rank_file_that_is_a_fifo_is_refused_without_opening_it_for_reading(tmp_path):
    """Before: open() on a FIFO blocked until someone wrote to it (the launcher hung)."""
    import os

    fifo = tmp_path / "ranks"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"LSB_DJOB_RANKFILE=.*ranks is not a regular file"):
        from_environment({"LSB_JOBID": "9", "LSB_DJOB_RANKFILE": str(fifo)}, hostname="nodeA")
    with pytest.raises(ConfigError, match=r"LSB_DJOB_RANKFILE=/dev/null is not a regular file"):
        from_environment({"LSB_JOBID": "9", "LSB_DJOB_RANKFILE": "/dev/null"}, hostname="nodeA")
