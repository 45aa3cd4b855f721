"""Every workload's job file, as printed, submitted with the real sbatch and run on two hosts; a training job that
reaches its time limit (the cluster tier: tests/cluster/virtual.py).

The jobs run side by side (each on two of the four hosts, one core a node), as a user's jobs share a cluster:
FSDP training whose time limit comes while it runs (SLURM's own warning, ``--signal=B:USR1@...``, cut short on
the sbatch command line), the same job uninterrupted, a simulation, and PPO. Before, the stand-in srun ran the
printed script's body; this is SLURM running the file.
"""

from __future__ import annotations

import json
import math
import re

import torch

from tests.cluster.conftest import TINY, hook_module, job_folder, output, printed, rank_logs, said, wait_for
from tests.conftest import ROOT

DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _fsdp_model(run, step: int) -> dict:
    """The model's weights of a sharded (DCP) checkpoint, gathered into one state dict in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = run / "checkpoints" / f"step_{step:08d}"
    whole = run / f"whole_{step}.pt"
    dcp_to_torch_save(folder, whole)
    model = torch.load(whole, weights_only=False)["tensors"]["model"]
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def _seconds(run_time: str) -> int:
    """SLURM's ``RunTime`` ([D-]HH:MM:SS) in seconds."""
    days, _, clock = run_time.rpartition("-")
    hours, minutes, seconds = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def test_each_workloads_job_file_runs_on_two_hosts_and_the_time_limit_requeues_fsdp_to_the_same_end(hosts):
    folder = job_folder(hosts, "workloads")
    # the first start's steps take half a second (rank 0 sleeps), so that the limit comes mid-run, and its first
    # step touches `ready`; the requeued start (SLURM_RESTART_COUNT=1) runs at full speed to its end
    env = hook_module(folder, "limit_here", "import os\nimport time\n\n\nclass Slow:\n"
                      "    def on_step(self, event):\n        if not os.environ.get('SLURM_RESTART_COUNT'):\n"
                      f"            open({str(folder / 'ready')!r}, 'a').close()\n"
                      "            time.sleep(0.5)\n\n\ndef hook():\n    return Slow()\n")
    two = ["--nnodes", "2", "--nproc-per-node", "1", "--threads", "1"]
    fsdp = ["train", "-f", "nano", *two, *TINY, "strategy=fsdp", "steps=400", "log_every=50",
            "checkpoint_every=1000"]
    limited = printed(hosts, folder, "limited.sbatch", *fsdp, "callbacks=[limit_here:hook]", env=env)
    clean = printed(hosts, folder, "fsdp.sbatch", *fsdp)
    sim = printed(hosts, folder, "sim.sbatch", "sim", "-f", "sir", *two, "--agents", "3001", "grid=[30,30]",
                  "--steps", "20", "compile=false", "plot=false")
    rl = printed(hosts, folder, "rl.sbatch", "rl", "-f", "ppo-cartpole", *two, "num_envs=8", "num_steps=8",
                 f"total_env_steps={8 * 8 * 6}", "target_return=null", "num_minibatches=2", "update_epochs=1")
    # SLURM's warning, cut short to 45 s before the limit, comes from its own time-limit check (about every 30 s).
    # The limit is set once the first start has stepped: a warning during the ranks' start-up has no step to
    # checkpoint (under load, start-up alone took longer than the 15 s that a 1-minute limit leaves)
    jobs = {"limited": hosts.sbatch(limited, "--time=5", "--signal=B:USR1@45", env=env),
            "fsdp": hosts.sbatch(clean), "sim": hosts.sbatch(sim), "rl": hosts.sbatch(rl)}
    wait_for(folder / "ready", hosts, jobs["limited"], 180)
    ran = _seconds(hosts.job(jobs["limited"])["RunTime"])
    # the limit at least 45 s away (the warning is then due within a check, and the step's checkpoint has 15 s
    # or more before the limit), in whole minutes
    hosts.slurm("scontrol", "update", f"JobId={jobs['limited']}", f"TimeLimit={max(1, math.ceil((ran + 50) / 60))}")
    hosts.wait_job(jobs["limited"], (*DONE, "PENDING", "RUNNING"), 240, restarts=1)
    # the requeued start keeps the job's limit: lift it, or that start is warned too before it ends
    hosts.slurm("scontrol", "update", f"JobId={jobs['limited']}", "TimeLimit=10")

    ends = {name: hosts.wait_job(job, DONE, 300, restarts=1 if name == "limited" else None)
            for name, job in jobs.items()}
    for name, info in ends.items():
        assert info["JobState"] == "COMPLETED" and info["NumNodes"] == "2", said(name, info, *output(folder, jobs[name]))

    out, err = output(folder, jobs["limited"])
    run = folder / "runs" / "train" / f"multigpu-train-{jobs['limited']}"
    stopped = re.findall(r"interrupted after step (\d+): checkpoint (\S+?);", out)
    assert len(stopped) == 1 and 0 < int(stopped[0][0]) < 400, said(out[-3000:], err[-3000:], rank_logs(run))
    step, checkpoint = stopped[0]
    assert checkpoint == str(run / "checkpoints" / f"step_{int(step):08d}"), stopped
    assert f"stopped by USR1 before the end (exit 143): requeueing job {jobs['limited']}" in err, err[-3000:]
    assert f"resuming from {checkpoint}" in out, out[-3000:]
    a = _fsdp_model(run, 400)
    b = _fsdp_model(folder / "runs" / "train" / f"multigpu-train-{jobs['fsdp']}", 400)
    assert a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "differs from the uninterrupted job"

    from multigpu.config import load_config
    from multigpu.sim.checkpoint import state_digest
    from multigpu.sim.config import SimConfig
    from multigpu.sim.engine import SimEngine

    summary = json.loads((folder / "runs" / "sim" / f"multigpu-sim-{jobs['sim']}" / "summary.json").read_text())
    engine = SimEngine(load_config(SimConfig, ROOT / "src/multigpu/presets/sir.yaml",
                                   ["agents=3001", "grid=[30,30]", "steps=20", "compile=false", "plot=false"]))
    engine.run()  # the same epidemic on one process: the agents do not depend on the split
    assert (summary["world_size"], summary["final_step"], summary["state_digest"]) == (2, 20, state_digest(engine))

    summary = json.loads((folder / "runs" / "rl" / f"multigpu-rl-{jobs['rl']}" / "summary.json").read_text())
    assert (summary["rl"]["world_size"], summary["rl"]["updates"]) == (2, 6), summary["rl"]
