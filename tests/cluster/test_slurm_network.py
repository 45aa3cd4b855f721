"""What a job says about the network between its hosts, under the real SLURM (the cluster tier).

A slow link (``tc``'s rate limit on both ends of one host's link: this machine's kernel has no ``netem`` for a
delay) is time the ranks spend communicating, not a slow
rank: the job's communication figures grow with it and no rank is named a straggler. A run folder that one host
does not see (a folder of its own there, where the others share one) ends the job in one line before anything
is trained.
"""

from __future__ import annotations

import json

from tests.cluster.conftest import TINY, job_folder, output, printed, said

DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
MBIT_S = 2


def test_a_slow_link_shows_as_communication_not_as_a_straggler(hosts):
    folder = job_folder(hosts, "slow")
    script = printed(hosts, folder, "train.sbatch", "train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1",
                     "--threads", "1", *TINY, "steps=60", "log_every=20")
    hosts.slow_link("node4", MBIT_S)  # node4's link carries 2 Mbit/s each way
    jobs = {"fast": hosts.sbatch(script, "--nodelist=node1,node2"), "slow": hosts.sbatch(script, "--nodelist=node3,node4")}
    summaries = {}
    for name, job in jobs.items():
        info = hosts.wait_job(job, DONE, 240)
        assert info["JobState"] == "COMPLETED", said(name, info, *output(folder, job))
        run = folder / "runs" / "train" / f"multigpu-train-{job}"
        summaries[name] = json.loads((run / "summary.json").read_text())
    fast, slow = summaries["fast"], summaries["slow"]
    for s in (fast, slow):
        assert s["stragglers"] == [], s["stragglers"]  # measured, and nobody named: the link, not a rank
        assert all(r["comm_s"] is not None for r in s["per_rank"]), s["per_rank"]
    per_step = {name: [r["comm_s"] / r["steps"] for r in s["per_rank"]] for name, s in summaries.items()}
    # DDP's all-reduce sends each step's gradients across the link: at 2 Mbit/s that is time every step waits
    sent = sum(kind["bytes"] for kind in slow["traffic"].values()) / max(r["steps"] for r in slow["per_rank"])
    assert min(per_step["slow"]) > max(per_step["fast"]) + 0.5 * sent * 8 / (MBIT_S * 1e6), (per_step, sent)
    assert slow["comm_share"] > fast["comm_share"], (slow["comm_share"], fast["comm_share"])


def test_a_run_folder_one_host_does_not_see_ends_the_job_in_one_line(hosts):
    folder = job_folder(hosts, "unshared")
    script = printed(hosts, folder, "train.sbatch", "train", "-f", "nano", "--nnodes", "2", "--nproc-per-node", "1",
                     "--threads", "1", *TINY, "steps=4")
    hosts.hide("node2", folder / "runs")  # node2 has a runs/ folder of its own there
    job = hosts.sbatch(script, "--nodelist=node1,node2")
    info = hosts.wait_job(job, DONE, 180)
    out, err = output(folder, job)
    assert info["JobState"] == "FAILED", said(info, out, err)
    lines = [line for line in err.splitlines() if line.startswith("error: ")]  # each node's line, in either order
    mine = [line for line in lines if line.startswith(
        "error: the run folder is not shared between nodes: node 0 made "
        f"runs/train/multigpu-train-{job} and marked it, but on node 1 (node2) ")]
    assert len(mine) == 1 and "valid: a --run-dir on a file system every node mounts at the same path" in mine[0], err
    assert set(lines) - set(mine) <= {"error: node 1 (node2) stopped before the job formed: " + mine[0][7:]}, lines
    assert "step 1/" not in out, out  # nothing was trained
