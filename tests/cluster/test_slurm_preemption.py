"""The job file as printed, submitted with the real sbatch, on two hosts: its warning, requeue and resume, a
cancel that ends it for good, and its time limit (the cluster tier: tests/cluster/virtual.py).

Before (each found on a real SLURM, each where the stand-in srun said all was well): on a cluster without GPUs
the printed file asked ``--gpus-per-node`` and sbatch refused it; the warning's trap sent SIGTERM to ``srun``,
which the real srun answers by killing its step at once (exit 137, no checkpoint at the warning: the requeued
job started over from the last periodic checkpoint, or from step 0); ``scancel`` ran the same trap and the
cancelled job came back; every rank printed torch's "[c10d] The hostname of the client socket cannot be
retrieved" on hosts without reverse DNS.
"""

from __future__ import annotations

import time

import torch

from tests.cluster import virtual
from tests.cluster.conftest import C10D_NOISE, TINY, hook_module, job_folder, output, printed, rank_logs, said, wait_for


def _model(run) -> dict:
    return torch.load(run / "checkpoints" / "step_00000004" / "state.pt", weights_only=True)["model"]


def test_the_warning_checkpoints_the_step_requeues_and_ends_bit_identical_and_a_cancel_ends_a_job_for_good(hosts):
    """Three jobs side by side: one warned at step 2, the same job uninterrupted, and a long one that the user
    cancels (``scancel JOBID``), which must stay cancelled."""
    folder = job_folder(hosts, "warned")
    env = hook_module(folder, "preempt_here", "from multigpu.testing.faults import WaitForSignal\n\n\n"
                      f"def hook():\n    return WaitForSignal(rank=0, step=2, ready={str(folder / 'ready')!r})\n")
    # as a user types it on a login node without GPUs: no --cpu, the cluster's nodes have none
    job = ["train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1", "--threads", "1", *TINY]
    warned = printed(hosts, folder, "warned.sbatch", *job, "steps=4", "checkpoint_every=100",
                     "callbacks=[preempt_here:hook]", env=env)
    clean = printed(hosts, folder, "clean.sbatch", *job, "steps=4", "checkpoint_every=100")
    long = printed(hosts, folder, "long.sbatch", *job, "steps=100000")
    text = warned.read_text()
    assert "#SBATCH --gpus-per-node" not in text, text  # sbatch refuses a GPU request on a cluster without GPUs
    first = hosts.sbatch(warned, env=env)
    reference = hosts.sbatch(clean)
    cancelled = hosts.sbatch(long)
    wait_for(folder / "runs" / "train" / f"multigpu-train-{cancelled}" / "metrics.jsonl", hosts, cancelled, 180)
    hosts.slurm("scancel", str(cancelled))  # a user stopping the job
    cancelled_at = time.monotonic()
    wait_for(folder / "ready", hosts, first, 180)  # rank 0 finished step 2 and waits: the warning lands there
    hosts.slurm("scancel", "--batch", "--signal=USR1", str(first))

    info = hosts.wait_job(first, ("COMPLETED", "FAILED", "CANCELLED"), 240, restarts=1)
    out, err = output(folder, first)
    assert info["JobState"] == "COMPLETED", said(info, out[-3000:], err[-3000:])
    run = folder / "runs" / "train" / f"multigpu-train-{first}"
    step2 = run / "checkpoints" / "step_00000002"
    assert f"interrupted after step 2: checkpoint {step2}" in out, said(out[-3000:], err[-3000:], rank_logs(run))
    assert f"stopped by USR1 before the end (exit 143): requeueing job {first}" in err, err[-3000:]
    assert f"resuming from {step2}" in out, out[-3000:]  # the warning's checkpoint, not step 0
    assert out.count("multigpu train: 2 rank(s)") == 4  # each node's header, in each of the two starts
    assert not C10D_NOISE.search(out + err), [line for line in err.splitlines() if C10D_NOISE.search(line)][:3]
    # each launcher waits until the other nodes' ranks stopped, node 0 (the store's host) until their launchers
    # ended: none talks to a store gone with node 0 (torch then prints C++ warnings with their stacks)
    assert "TCPStore.cpp" not in err, said(err[-3000:])

    ref = hosts.wait_job(reference, ("COMPLETED", "FAILED", "CANCELLED"), 240)
    assert ref["JobState"] == "COMPLETED", said(ref, *output(folder, reference))
    a, b = _model(run), _model(folder / "runs" / "train" / f"multigpu-train-{reference}")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "differs from the uninterrupted job"

    # a requeued job would be pending or running again CRED_EXPIRE_S after it ended
    time.sleep(max(0.0, cancelled_at + virtual.CRED_EXPIRE_S + 5 - time.monotonic()))
    info = hosts.job(cancelled)
    _, err = output(folder, cancelled)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", said(info, err[-2000:])
    assert "requeueing" not in err, err[-2000:]
