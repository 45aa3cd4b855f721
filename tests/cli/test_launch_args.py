"""Argument translation to torch's launcher, with torch's elastic_launch mocked (tier 0).

Only `_elastic_launch`, our one seam over torch, is replaced; everything up to it is real.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest

from multigpu.cli import main
from multigpu.launch._worker import worker_device_env
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import HostFacts, parse_gpus, plan_devices
from tests.conftest import SCRIPTS, run_file

HELLO = str(SCRIPTS / "fail_rank1.py")  # any existing script; nothing runs it here


@pytest.fixture
def seam():
    with mock.patch("multigpu.launch.agent._elastic_launch") as fake:
        yield fake


def _launched(seam):
    (config, entrypoint, args), _ = seam.call_args
    return config, entrypoint, list(args)


def test_auto_on_a_cpu_box_is_one_rank_on_a_free_port(seam, fake_gpus):
    fake_gpus(0)
    assert main(["launch", HELLO, "--lr", "3"]) == 0
    config, entrypoint, args = _launched(seam)
    assert config.nproc_per_node == 1 and config.min_nodes == config.max_nodes == 1
    # torch's c10d rendezvous on stores bound to the endpoint's address (launch/stores.py): loopback here
    assert config.rdzv_backend == "multigpu" and config.rdzv_endpoint == "localhost:0"
    assert config.rdzv_configs["is_host"] is True
    assert args[-3:] == [HELLO, "--lr", "3"] and args[1].endswith("_worker.py")


def test_standalone_nproc_restarts_and_underscore_aliases(seam, fake_gpus):
    fake_gpus(0)
    assert main(["launch", "--standalone", "--nproc_per_node", "3", "--max-restarts", "2", HELLO]) == 0
    config, _, _ = _launched(seam)
    assert (config.nproc_per_node, config.max_restarts, config.rdzv_endpoint) == (3, 2, "localhost:0")


def test_multi_node_flags(seam, fake_gpus, monkeypatch, capsys):
    fake_gpus(0)
    argv = ["launch", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29400", "--nproc-per-node", "2", HELLO]
    # the rendezvous store is on the network, so the nodes sign its state with a secret they share
    for value, said in (("", "MULTIGPU_RDZV_SECRET is not set"), ("short", "MULTIGPU_RDZV_SECRET has 5 characters")):
        monkeypatch.setenv("MULTIGPU_RDZV_SECRET", value)
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --nnodes 2: " + said) and "\n" not in err and "openssl rand" in err, err
        assert not seam.called
    monkeypatch.setenv("MULTIGPU_RDZV_SECRET", "0123456789abcdef")
    seam.side_effect = lambda *a: seam.env.append(os.environ.get("MULTIGPU_RDZV_SECRET"))
    seam.env = []
    assert main(argv) == 0
    assert seam.env == [None]  # the workers do not inherit it
    config, _, _ = _launched(seam)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (2, 2, 2)
    assert config.rdzv_endpoint == "node0:29400" and config.rdzv_configs["is_host"] is False
    assert config.run_id == "multigpu"  # every node must agree on it
    assert "0123456789abcdef" not in repr(config)  # handed to the handler in memory, not through torch's config


def test_nnodes_min_max_is_an_elastic_job_as_torchrun_means_it(seam, fake_gpus, monkeypatch, capsys):
    fake_gpus(0)
    monkeypatch.setenv("MULTIGPU_RDZV_SECRET", "0123456789abcdef")
    base = ["launch", "--node-rank", "1", "--rdzv-endpoint", "node0:29400", HELLO]
    assert main(["launch", "--nnodes", "1:3", *base[1:]]) == 0
    config, _, _ = _launched(seam)
    # torch's agent forms the job on 1 to 3 nodes; a lost node needs a restart left to go on without it
    assert (config.min_nodes, config.max_nodes, config.max_restarts) == (1, 3, 3)
    assert main(["launch", "--nnodes", "1:3", "--max-restarts", "1", *base[1:]]) == 0
    assert _launched(seam)[0].max_restarts == 1
    capsys.readouterr()
    for bad, said in (("3:2", "error: --nnodes 3:2 is invalid; valid: MIN:MAX with MIN <= MAX"),
                      ("a:b", "error: argument --nnodes: 'a:b' is invalid; valid: a whole number of nodes, or MIN:MAX")):
        seam.reset_mock()
        assert main(["launch", "--nnodes", bad, *base[1:]]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(said) and "\n" not in err, err
        assert not seam.called


def test_module_target(seam, fake_gpus):
    fake_gpus(0)
    assert main(["launch", "-m", "json.tool", "--help"]) == 0
    _, _, args = _launched(seam)
    assert args[-3:] == ["-m", "json.tool", "--help"]


def test_gpu_selection_and_isolation_plans():
    facts = HostFacts(gpu_count=4, visible="4,5,6,7", cores=16)
    plan = plan_devices(LaunchConfig(gpus="0,2"), facts, inherited={})
    assert plan.nproc_per_node == 2 and plan.env["CUDA_VISIBLE_DEVICES"] == "4,6"  # mapped through the parent's
    assert plan.env["OMP_NUM_THREADS"] == "8"
    iso = plan_devices(LaunchConfig(gpus="1,3", isolate_devices=True), facts, inherited={})
    assert iso.env["MULTIGPU_DEVICE_MAP"] == "5,7" and "CUDA_VISIBLE_DEVICES" not in iso.env
    hybrid = plan_devices(LaunchConfig(gpus="2", nproc_per_node=3, allow_cpu_ranks=True), facts, inherited={})
    assert hybrid.hybrid and not plan.hybrid and hybrid.gpu_ids == ["4", "5"] and iso.isolated and not plan.isolated
    assert hybrid.device_types == ["cuda", "cpu"] and plan.device_types == ["cuda"]
    ours = ("MULTIGPU_DEVICE_MAP",)  # the documented one (multigpu/envvars.py)
    assert not any(k.startswith("MULTIGPU_") and k not in ours for p in (plan, iso, hybrid) for k in p.env)
    # a hybrid job's CPU ranks (local rank 2 here) see no GPU: nothing of theirs can land on one (the worker
    # wrapper reads gpu_ranks from the run file)
    assert hybrid.gpu_ranks == 2 and plan.gpu_ranks is None
    assert [worker_device_env(hybrid.env, r, hybrid.gpu_ranks).get("CUDA_VISIBLE_DEVICES")
            for r in range(3)] == [None, None, ""]
    assert plan_devices(LaunchConfig(), facts, inherited={"OMP_NUM_THREADS": "2"}).env.get("OMP_NUM_THREADS") is None
    assert plan_devices(LaunchConfig(cpu=True, nproc_per_node=2), facts, inherited={}).env["CUDA_VISIBLE_DEVICES"] == ""
    assert parse_gpus("all", 3) == [0, 1, 2] and parse_gpus("2", 3) == [0, 1] and parse_gpus("0,", 3) == [0]


def test_ranks_beyond_memory_are_refused_and_beyond_cores_are_said():
    """On made-up figures: 100000 CPU ranks (they once filled the machine) are refused; 4 ranks on 2 cores run, said to
    share them."""
    from multigpu.errors import DeviceError
    from multigpu.launch.devices import RANK_RESIDENT_BYTES

    facts = HostFacts(gpu_count=0, cores=2, available_bytes=4 << 30)
    with pytest.raises(DeviceError, match="valid: --nproc-per-node at most 20 on this machine"):
        plan_devices(LaunchConfig(nproc_per_node=100000), facts, inherited={})
    plan = plan_devices(LaunchConfig(nproc_per_node=4), facts, inherited={})
    assert "4 CPU ranks on 2 core(s): 1 thread(s) per rank, so ranks share cores" in plan.note
    assert plan.memory_per_rank("cpu") == (4 << 30) // 4 - RANK_RESIDENT_BYTES and plan.memory_per_rank("cuda") is None
    assert "core" not in (plan_devices(LaunchConfig(nproc_per_node=2), facts, inherited={}).note or "")
    gpus = HostFacts(gpu_count=2, cores=2, available_bytes=4 << 30, gpu_memory_bytes=80 << 30)
    hybrid = plan_devices(LaunchConfig(nproc_per_node=5, allow_cpu_ranks=True), gpus, inherited={})
    assert "3 CPU ranks on 2 core(s)" in hybrid.note and hybrid.memory_per_rank("cuda") == 80 << 30
    unknown = plan_devices(LaunchConfig(nproc_per_node=64), HostFacts(gpu_count=0, cores=64), inherited={})
    assert unknown.memory_per_rank() is None  # no figure: nothing refused


@pytest.mark.parametrize(
    "argv,gpus,needle",
    [
        (["--gpus", "5"], "2", "asks for 5 GPU(s) but this machine has 2"),
        (["--gpus", "5"], "0", "no visible GPU"),
        (["--gpus", "0,0"], "2", "names GPU 0 twice"),
        (["--gpus", "-1"], "2", "not understood"),
        (["--gpus", "abc"], "2", "not understood"),
        (["--gpus", "0,3"], "2", "names GPU 3 but this machine has 2"),
        (["--nproc-per-node", "0"], "0", "valid: a whole number >= 1"),
        (["--nproc-per-node", "x"], "0", "is not a whole number"),
        (["--nproc-per-node", "3"], "2", "--allow-cpu-ranks"),
        (["--node-rank", "2", "--nnodes", "2"], "0", "--node-rank 2 is invalid with --nnodes 2; valid: 0 to 1"),
        (["--rdzv-endpoint", "node0"], "0", "needs a host and a port"),
        (["--rdzv-endpoint", "node0:http"], "0", "valid: a number from 0 to 65535"),
        (["--nnodes", "2", "--rdzv-endpoint", "node0:0"], "0", "port 0 only works on one node"),
        (["--cpu", "--gpus", "1"], "2", "contradict"),
        (["--isolate-devices"], "0", "no visible GPU"),
        (["--bogus"], "0", "unrecognized arguments"),
        (["--node-rank=--"], "0", "expected one value, got '--'"),  # found by the bad-input suite
    ],
)
def test_bad_input_is_one_line_and_exit_2(seam, fake_gpus, capsys, argv, gpus, needle):
    fake_gpus(int(gpus))
    code = main(["launch", *argv, HELLO])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert needle in err
    seam.assert_not_called()


def test_missing_script_and_debug_traceback(seam, capsys):
    assert main(["launch", "no_such_script.py"]) == 2
    assert "script 'no_such_script.py' does not exist" in capsys.readouterr().err
    from multigpu.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["--debug", "launch", "no_such_script.py"])


def test_one_node_ranks_meet_in_a_private_folder_that_goes_with_the_job(seam, fake_gpus, monkeypatch):
    """On one node, mg.init() ranks meet through a FileStore in a 0700 folder (not the workers' TCP
    store on loopback, which any local user can reach); several nodes have no common folder."""
    fake_gpus(0)
    seen = []
    seam.side_effect = lambda *a: seen.append((folder := run_file().get("private_store"),
                                                folder and os.stat(folder).st_mode & 0o777))
    assert main(["launch", "--nproc-per-node", "2", HELLO]) == 0
    (folder, mode), = seen
    assert mode == 0o700 and not os.path.exists(folder)
    monkeypatch.setenv("MULTIGPU_RDZV_SECRET", "0123456789abcdef")
    assert main(["launch", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29400", HELLO]) == 0
    assert seen[1] == (None, None)
