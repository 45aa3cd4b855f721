"""torchrun's and accelerate's flags launch the same job as ours (torch's launcher mocked), and say so once."""

from __future__ import annotations

import os
from unittest import mock

import pytest

from multigpu.cli import main
from tests.conftest import SCRIPTS, run_file

HELLO = str(SCRIPTS / "allreduce_loop.py")


def _launched(argv, fake_gpus, capsys, gpus=4):
    fake_gpus(gpus)
    seen = []

    def launch(config, entrypoint, args):
        seen.append((config, {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "ACCELERATE_MIXED_PRECISION")},
                     run_file()["run"]))

    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=launch):
        assert main(["launch", *argv, HELLO]) == 0
    config, env, run = seen[0]
    run_id = config.run_id if config.min_nodes > 1 else None  # a fresh random id on one node
    shape = (config.nproc_per_node, config.min_nodes, config.rdzv_endpoint, run_id,
             dict(config.rdzv_configs), env["CUDA_VISIBLE_DEVICES"])
    return shape, env, capsys.readouterr().err


@pytest.mark.parametrize("theirs,ours,said", [
    (["--master-addr", "node0", "--master-port", "29400", "--nnodes", "2", "--node-rank", "1", "--rdzv-id", "job7"],
     ["--rdzv-endpoint", "node0:29400", "--nnodes", "2", "--node-rank", "1", "--run-id", "job7"],
     "--master-addr/--master-port is --rdzv-endpoint node0:29400 here"),
    (["--rdzv-backend", "static", "--master-addr", "node0", "--nnodes", "2", "--node-rank", "1"],
     ["--rdzv-endpoint", "node0:29500", "--nnodes", "2", "--node-rank", "1"], "is --rdzv-endpoint node0:29500 here"),
    (["--nproc-per-node", "gpu"], ["--gpus", "all"], ""),
    (["--num-processes", "4", "--num-machines", "2", "--machine-rank", "1", "--main-process-ip", "10.0.0.1",
      "--main-process-port", "6000"],
     ["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "10.0.0.1:6000"],
     "--num-processes 4 is --nproc-per-node 2 here (accelerate counts the processes of all machines)"),
    (["--gpu-ids", "1,3"], ["--gpus", "1,3"], "--gpu-ids is --gpus 1,3 here"),
    (["--gpu-ids", "2"], ["--gpus", "2,"], "--gpu-ids is --gpus 2, here"),  # accelerate's 2 is GPU 2, not two GPUs
])
def test_other_launchers_flags_launch_the_same_job(theirs, ours, said, fake_gpus, capsys, monkeypatch):
    monkeypatch.setenv("MULTIGPU_RDZV_SECRET", "0123456789abcdef")  # several nodes need one
    a, _, err = _launched(theirs, fake_gpus, capsys)
    b, _, _ = _launched(ours, fake_gpus, capsys)
    assert a == b
    if said:
        assert err.count(said) == 1, err


def test_torchrun_nproc_cpu_and_accelerate_mixed_precision(fake_gpus, capsys, monkeypatch):
    monkeypatch.setattr("multigpu.runtime.env.cpu_count", lambda: 3)  # the cores this process may use, made up
    (nproc, *_), env, err = _launched(["--nproc-per-node", "cpu", "--mixed-precision", "bf16"], fake_gpus, capsys)
    assert nproc == 3  # one worker per core, as torchrun's "cpu"
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"  # what accelerate reads
    assert "--mixed-precision is precision=bf16 here" in err


@pytest.mark.parametrize("argv,message", [
    (["--rdzv-backend", "etcd"], "--rdzv-backend etcd is not supported"),
    (["--num-processes", "3", "--num-machines", "2"], "does not split over --num-machines 2"),
    (["--mixed-precision", "fp8"], "valid: no, fp16, bf16"),
    (["--master-port", "http"], "is not a whole number"),
    (["--rdzv-endpoint", "a:1", "--master-addr", "b"], "give the rendezvous address once"),
])
def test_bad_alias_values_are_one_line(argv, message, fake_gpus, capsys):
    fake_gpus(0)
    with mock.patch("multigpu.launch.agent._elastic_launch") as seam:
        assert main(["launch", *argv, HELLO]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and not seam.called


def test_mixed_precision_sets_a_workloads_precision(tmp_path, fake_gpus, capsys):
    fake_gpus(0)
    seen = []
    with mock.patch("multigpu.launch.agent._elastic_launch", side_effect=lambda *a: seen.append(run_file())):
        assert main(["train", "--mixed-precision", "bf16", "--run-dir", str(tmp_path / "r"), "steps=1"]) == 0
    assert seen[0]["config"]["precision"] == "bf16"
    assert main(["rl", "--mixed-precision", "bf16", "--run-dir", str(tmp_path / "q")]) == 2
    assert "the rl workload has no precision setting" in capsys.readouterr().err


ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
enable_cpu_affinity: false
gpu_ids: all
machine_rank: 0
main_process_ip: null
main_process_port: null
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def test_an_accelerate_config_file_launches_what_it_says_and_names_what_it_ignores(tmp_path, fake_gpus, capsys):
    """accelerate users keep num_processes, mixed_precision, ... in `accelerate config`'s file: `--config_file`
    (accelerate's spelling) reads it; the command line wins over it, as under `accelerate launch`."""
    config = tmp_path / "default_config.yaml"
    config.write_text(ACCELERATE_CONFIG)
    (nproc, *_, visible), env, err = _launched(["--config_file", str(config)], fake_gpus, capsys)
    assert (nproc, visible, env["ACCELERATE_MIXED_PRECISION"]) == (2, "", "bf16")  # use_cpu: no GPU for the ranks
    assert (f"accelerate config {config}: taken: distributed_type MULTI_CPU (--cpu), mixed_precision bf16, "
            "num_processes 2") in err
    assert "ignored" not in err and " here" not in err  # the rest is at accelerate's defaults; one line, no chatter
    (nproc, *_), _, _ = _launched(["--config-file", str(config), "--num-processes", "1"], fake_gpus, capsys)
    assert nproc == 1
    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text(ACCELERATE_CONFIG.replace("MULTI_CPU", "FSDP").replace("use_cpu: true", "use_cpu: false")
                    + "fsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n")
    (nproc, *_), env, err = _launched(["--config-file", str(fsdp)], fake_gpus, capsys)
    assert nproc == 2 and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    assert f"accelerate config {fsdp}: ignored distributed_type FSDP (" in err and ", fsdp_config" in err


@pytest.mark.parametrize("text,message", [
    (None, "no such file"),
    ("- a list\n", "is not an accelerate config"),
    ("num_processes: [\n", "cannot be read as an accelerate config"),
    ("mixed_precision: fp8\n", "mixed_precision 'fp8' is not run here; valid: no, fp16, bf16"),
])
def test_a_bad_accelerate_config_file_is_one_line(text, message, tmp_path, fake_gpus, capsys):
    fake_gpus(0)
    config = tmp_path / "c.yaml"
    if text is not None:
        config.write_text(text)
    with mock.patch("multigpu.launch.agent._elastic_launch") as seam:
        assert main(["launch", "--config_file", str(config), HELLO]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err and not seam.called
