"""Nodes that are lost while a job runs under the real SLURM (the cluster tier: tests/cluster/virtual.py).

Before: ``--nnodes 1:2`` asked ``#SBATCH --nodes=1-2`` beside ``--ntasks-per-node=1``, and SLURM gave it one node
while the other was idle (the job trained on 1 rank; its header said 2); a host whose every process was killed
was named only after a line that blamed the survivor ("rank 0 (local rank 0 on node 0, node1) died (exit code 1):
... Connection reset by peer").
"""

from __future__ import annotations

import json
import re
import time

from tests.cluster.conftest import TINY, job_folder, output, printed, said

BEAT = ["--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=3"]
"""A lost node is known after 3 s without its heartbeat (torch's own default: 15 s)."""


def _steps(run) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"loss"' in line]


def _wait_steps(cluster, job: int, run, step: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not (_steps(run) and max(_steps(run)) >= step):
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), said(state, *output(run.parents[2], job))
        assert time.monotonic() < deadline, output(run.parents[2], job)
        time.sleep(0.2)


def _nodes(info: dict) -> list[str]:
    """SLURM's node list (``node[1-2]``, ``node3``) as names."""
    text = info["NodeList"]
    found = re.fullmatch(r"(\w+?)\[(\d+)-(\d+)\]", text)
    if found:
        return [f"{found[1]}{i}" for i in range(int(found[2]), int(found[3]) + 1)]
    return text.split(",")


def test_an_elastic_job_gets_every_free_node_and_goes_on_when_one_dies_naming_it_not_its_survivor(hosts):
    folder = job_folder(hosts, "elastic")
    script = printed(hosts, folder, "elastic.sbatch", "train", "-f", "nano", "--nnodes", "1:2", "--nproc-per-node",
                     "1", "--threads", "1", *TINY, "steps=60", "checkpoint_every=4", *BEAT)
    job = hosts.sbatch(script)
    info = hosts.wait_job(job, ("RUNNING",), 60)
    assert info["NumNodes"] == "2", info  # both were free
    run = folder / "runs" / "train" / f"multigpu-train-{job}"
    _wait_steps(hosts, job, run, 6)
    lost = _nodes(info)[1]
    hosts.kill_host(lost)  # the launcher, its rank, slurmd, slurmstepd: the machine died

    info = hosts.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED"), 240)
    out, err = output(folder, job)
    assert info["JobState"] == "COMPLETED", said(info, out[-3000:], err[-4000:])
    named = [line for line in err.splitlines() if "was lost" in line]
    assert named and named[0].startswith(f"multigpu: node 1 ({lost})"), err[-4000:]
    blamed = [line for line in err.splitlines() if re.search(r"rank 0 \(local rank 0 on node 0, \w+\) died", line)]
    assert not blamed, err[-4000:]  # the survivor lost its peer; it did not die
    first = err.index(named[0])
    assert not any(word in err[:first] for word in ("died", "failed first")), err[:first][-3000:]
    resized = [json.loads(line) for line in (run / "resizes.jsonl").read_text().splitlines()]
    assert [(r["from_ranks"], r["to_ranks"], r["check"]["bit_exact"]) for r in resized] == [(2, 1, True)], resized
    assert max(_steps(run)) == 60


def test_a_host_cut_off_the_network_is_named_and_its_peers_are_not_blamed(hosts):
    folder = job_folder(hosts, "partitioned")
    script = printed(hosts, folder, "fixed.sbatch", "train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1",
                     "--threads", "1", *TINY, "steps=100000", *BEAT)
    job = hosts.sbatch(script)
    info = hosts.wait_job(job, ("RUNNING",), 60)
    run = folder / "runs" / "train" / f"multigpu-train-{job}"
    _wait_steps(hosts, job, run, 3)
    cut = _nodes(info)[1]
    hosts.partition(cut)
    started = time.monotonic()
    deadline = started + 60
    while "was lost" not in output(folder, job)[1] and time.monotonic() < deadline:
        time.sleep(0.2)
    took = time.monotonic() - started
    out, err = output(folder, job)
    named = [line for line in err.splitlines() if "was lost" in line]
    assert named, err[-4000:]
    assert named[0].startswith(f"error: node 1 ({cut})") and took < 3 + 10, (took, named)
    first = err.index(named[0])
    assert not any(word in err[:first] for word in ("died", "failed first")), err[:first][-3000:]
