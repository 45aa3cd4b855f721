"""Two launchers on loopback configured only by a scheduler's environment form one 2-node job.

Before, `multigpu launch` under `srun` or a Kubeflow PyTorchJob ignored SLURM_* and PET_* and ran each node as a
job of its own (nnodes 1). The test holds the rendezvous store itself (is_host=false), as test_launch_e2e's
two-node test does, so no port is chosen by hand.

What SLURM does is tested on a real SLURM (tests/cluster); here only what no real one can be had for
(Kubeflow's PyTorchJob: its pods' variables, as the training operator sets them) and launcher behaviour on
loopback that no scheduler decides.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def _node_env(kind: str, node_rank: int, port: int) -> dict[str, str]:
    if kind == "slurm":
        return {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": str(node_rank),
                "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NTASKS_PER_NODE": "1", "MASTER_PORT": str(port)}
    return {"PET_NNODES": "2", "PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port), "PET_NPROC_PER_NODE": "1"}


@pytest.mark.parametrize("kind", ["pet"])  # SLURM's: tests/cluster, on a real SLURM
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
    assert script[3].startswith("#SBATCH --gpus-per-node=4")  # where SLURM cannot be asked: --nproc-per-node's
    # the node flags: SLURM's; one launcher per node; a node that fails ends the step
    srun = [line for line in script if line.startswith("srun ")]
    assert srun == ["srun --ntasks-per-node=1 --kill-on-bad-exit=1 multigpu launch --nproc-per-node 4 "
                    "examples/hello.py --x 1 &"]
    assert main(["train", "-f", "nano", "--nnodes=3", "--gpus", "0,1", "--print_k8s", "steps=10"]) == 0
    job = next(d for d in yaml.safe_load_all(capsys.readouterr().out) if d["kind"] == "PyTorchJob")
    assert (job["kind"], job["spec"]["nprocPerNode"]) == ("PyTorchJob", "2")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 2)
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    # the run folder on the job's shared volume; a pod Kubernetes restarts continues it
    assert container["command"] == ["multigpu", "train", "-f", "nano", "--gpus", "0,1", "steps=10",
                                    "--checkpoint-on-interrupt", "--run-dir", f"/runs/{job['metadata']['name']}", "--resume", "auto"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert main(["launch", "--print-sbatch", "--print-k8s", "examples/hello.py"]) == 2


# ----------------------------------------------------------------------------- the generated files, run as written
_TINY = ["model.kwargs.n_layer=1", "model.kwargs.n_head=2", "model.kwargs.n_embd=16", "block_size=16",
         "data.kwargs.max_chars=20000", "global_batch_size=8", "checkpoint_every=2", "keep_last=5", "warmup_steps=1",
         "eval_every=0", "eval_batches=1", "log_every=1", "sample_chars=0", "prefetch=0", "logger=[]"]
"""A training job of a few seconds a step on 2 CPU ranks."""

def _reserved_port():
    """A port no other process is handed while the returned socket lives: bound (SO_REUSEADDR) but not listening,
    so the launcher of node 0 can still bind and listen on it (it sets SO_REUSEADDR too). No fixed port, no race."""
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _printed(capsys, *argv: str) -> str:
    from multigpu.cli import main

    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_the_pytorchjob_runs_as_written_with_the_variables_kubeflow_sets(tmp_path, capsys):
    """Each replica's container command, run as the training operator runs it: PET_* from the job, the secret
    from the generated Secret (through secretKeyRef), the run volume's mount at a folder of this machine."""
    import yaml

    printed = _printed(capsys, "train", "--nnodes", "2", "--cpu", "--nproc-per-node", "1", *_TINY, "steps=2",
                       "--print-k8s")
    docs = {d["kind"]: d for d in yaml.safe_load_all(printed)}
    job, secret = docs["PyTorchJob"], docs["Secret"]
    volume = tmp_path / "volume"  # what the claim holds, mounted at /runs in every pod
    volume.mkdir()
    port = _reserved_port()
    procs = []
    try:
        for rank, role in enumerate(["Master", "Worker"]):
            container = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]
            mount = next(m["mountPath"] for m in container["volumeMounts"] if m["name"] == "runs")
            command = [str(volume) + a[len(mount):] if a.startswith(mount + "/") else a for a in container["command"]]
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MULTIGPU_RDZV", "PET_"))}
            for item in container["env"]:
                ref = item["valueFrom"]["secretKeyRef"]
                assert ref["name"] == secret["metadata"]["name"]
                env[item["name"]] = secret["stringData"][ref["key"]]
            env.update({"PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": "127.0.0.1",
                        "PET_MASTER_PORT": str(port.getsockname()[1]), "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
                        "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
                        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}"})
            procs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True, start_new_session=True))
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        port.close()
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    run = volume / job["metadata"]["name"]
    assert (run / "checkpoints" / "step_00000002" / "manifest.json").is_file() and (run / "summary.json").is_file()


@pytest.mark.parametrize("case", ["node 0's endpoint resolves to loopback", "node 1's script is missing"])
def test_a_node_that_fails_before_the_job_forms_stops_the_others_within_seconds(case, tmp_path):
    """Before: node 0 refusing an endpoint that resolves to loopback (or any node failing before the rendezvous)
    stopped at once, and the other node waited its whole join timeout (600 s) for it."""
    import time

    host = "127.0.0.1"
    if case.startswith("node 0"):
        host = socket.gethostname()
        try:
            if not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
                pytest.skip(f"this machine's name {host} does not resolve to loopback")
        except OSError:
            pytest.skip(f"this machine's name {host} does not resolve")
    port = socket.socket()
    port.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    port.bind((socket.gethostbyname(host), 0))
    base = [sys.executable, "-m", "multigpu", "launch", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"{host}:{port.getsockname()[1]}"]
    scripts = ["examples/hello.py", "examples/hello.py" if case.startswith("node 0") else str(tmp_path / "gone.py")]
    start = time.monotonic()
    procs = [subprocess.Popen([*base, "--node-rank", str(r), scripts[r]], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, **_SECRET, "OMP_NUM_THREADS": "1"},
                              start_new_session=True)
             for r in range(2)]
    try:
        outs = _finish(procs, 90)
    finally:
        port.close()
    took = time.monotonic() - start
    failed = 0 if case.startswith("node 0") else 1
    own = outs[failed][1].strip().splitlines()[-1]
    other = outs[1 - failed][1].strip().splitlines()[-1]
    assert procs[failed].returncode == 2 and own.startswith("error: ") and ("loopback" in own or "gone.py" in own)
    assert procs[1 - failed].returncode == 1
    assert other == f"error: node {failed} ({socket.gethostname()}) stopped before the job formed: {own[7:]}"
    assert took < 60, took  # within seconds of the failure (start-up included), not the 600 s join timeout


_SECRET = {"MULTIGPU_RDZV_SECRET": "0123456789abcdef0123"}


def _finish(procs, timeout: float) -> list[tuple[str, str]]:
    """Every process's output; one still running after ``timeout`` (a node left waiting) is killed, with its
    children (its own session), and the test fails."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_every_nodes_logs_are_in_the_run_folder_and_node_0_names_a_failure_on_node_1(tmp_path):
    """Two loopback nodes, one run folder; rank 1 (on node 1) raises at step 2. Before, each node kept its worker
    logs in a folder of a random name (none at all unless --log-dir was given), and node 0's summary said only
    that its own rank lost its peer: the error on node 1 was named nowhere on node 0."""
    from torch.distributed import TCPStore

    (tmp_path / "boom_here.py").write_text(
        "from multigpu.runtime import group\n\n\nclass Boom:\n    def on_step(self, event):\n"
        "        if event.step == 2 and group.rank() == 1:\n            raise RuntimeError('boom on rank 1')\n\n\n"
        "def hook():\n    return Boom()\n")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # we keep the socket
    run = tmp_path / "run"
    env = {**os.environ, **_SECRET, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "multigpu", "train", "--nnodes", "2", "--node-rank", str(rank), "--cpu",
         "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false",
         "--run-dir", str(run), *_TINY, "steps=6", "callbacks=[boom_here:hook]"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for rank in range(2)]
    outs = _finish(procs, 180)
    assert [p.returncode for p in procs] == [1, 1], outs
    node1 = outs[1][1]
    assert "rank 1 of 2 failed first (exit code 1): RuntimeError: boom on rank 1" in node1, node1[-3000:]
    node0 = outs[0][1]
    assert "  on other nodes (their error files in the shared run folder):" in node0, node0[-3000:]
    named = [line.strip() for line in node0.splitlines() if line.strip().startswith("node 1: rank 1 failed at ")]
    assert len(named) == 1 and named[0].endswith(f": RuntimeError: boom on rank 1 ({run}/logs/node1/start0/attempt_0/0/"
                                                 "error.json)"), node0[-3000:]
    logs = run / "logs"
    assert "step 1/6" in (logs / "node0" / "rank0.log").read_text()  # each node's ranks, by global rank
    attempt = logs / "node1" / "start0" / "attempt_0" / "0"  # torch's files, in this node's folder for this start
    assert "boom on rank 1" in (attempt / "error.json").read_text()
    assert (logs / "node1" / "rank1.stderr.log").samefile(attempt / "stderr.log")
    assert (logs / "node1" / "rank1.log").samefile(attempt / "stdout.log")
