"""Elastic jobs (``--nnodes 1:2``) on two loopback nodes lose one (its launcher SIGKILLed) and go on.

One launch per workload, several assertions each: the survivor names the lost node in one line, torch's agent
re-forms the job at the smaller size, the run resumes its newest checkpoint re-split for one rank, the resize is
recorded (from 2 to 1 ranks, the step, the check that the state loaded is the state saved) in the run folder and
in summary.json; then the lost node comes back (a new launcher with the same rendezvous and run folder), the job
grows to 2 ranks again (records 2 -> 1 -> 2) and finishes every step. Training keeps its global batch (the check
bit-exact for ddp); the simulation's re-partitioned agents and PPO's re-split environments are checked bit for
bit against the digest saved with the checkpoint, and the simulation ends with the agents an uninterrupted
one-rank run ends with. One harness (:func:`_lose_and_rejoin`) drives all three. The tests hold the rendezvous store themselves (is_host=false),
as the other two-node tests do, so no port is chosen by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

_TINY = ["model.kwargs.n_layer=1", "model.kwargs.n_head=2", "model.kwargs.n_embd=16", "block_size=16",
         "data.kwargs.max_chars=20000", "batch_size=4", "checkpoint_every=5", "warmup_steps=1",
         "eval_every=0", "eval_batches=1", "log_every=0", "sample_chars=0", "prefetch=0", "logger=[]",
         "keep_last=100"]


@pytest.mark.fault
def test_an_elastic_train_job_loses_a_node_gets_it_back_and_keeps_its_global_batch_with_its_resize_records(tmp_path):
    run = tmp_path / "run"
    steps = 250
    procs, outputs = _lose_and_rejoin(tmp_path, ["train", "-f", "nano", *_TINY, f"steps={steps}"], run)
    (out, err), (_, err_new) = outputs[0], outputs[2]
    assert procs[0].returncode == 0 and procs[2].returncode == 0, (err, err_new)
    _lost_line(err, "train")
    resized = re.findall(r"multigpu train: resized from (\d) to (\d) rank\(s\) at step (\d+): the state loaded equals "
                         r"the saved one \(max relative difference 0\.0e\+00, tolerance 1e-09\)", out)
    assert [(int(a), int(b)) for a, b, _ in resized] == [(2, 1), (1, 2)], out
    assert "keeps the global batch of 8 samples per step" in out and "the global batch stays 8 samples per step" \
        in out, out  # grad_accum 1 -> 2 on one rank, then back to 1 on two
    assert f"done: step {steps}," in out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["final_step"], summary["effective_batch"]) == (2, steps, 8)
    records = summary["resizes"]
    assert [(r["from_ranks"], r["to_ranks"], r["step"]) for r in records] == [(int(a), int(b), int(s))
                                                                                for a, b, s in resized]
    for record in records:
        assert record["check"]["equal"] and record["check"]["bit_exact"], record
        assert record["checkpoint"].endswith(f"step_{record['step']:08d}")
    assert records[0]["step"] < records[1]["step"] < steps
    assert [json.loads(line) for line in (run / "resizes.jsonl").read_text().splitlines()] == records


_PACE = """import os, time


class Paced:
    def on_step(self, event):
        if os.path.exists(os.environ["PACE_GATE"]):
            time.sleep(0.1)


def hook():
    return Paced()
"""


def _sir(steps: int, checkpoint_every: int, *keys: str) -> list[str]:
    """The elastic tests' simulation: SIR on 3,001 agents of a 30 x 30 grid, uncompiled, no plot, no log lines."""
    return ["sim", "-f", "sir", "--agents", "3001", "grid=[30,30]", f"--steps={steps}", "--checkpoint-every",
            str(checkpoint_every), *keys, "compile=false", "plot=false", "log_every=0"]


def _paced_launchers(tmp_path, workload: list[str], run):
    """``multigpu WORKLOAD --nnodes 1:2`` on two loopback nodes (an external store, 3 s heartbeat deadline), each
    step paced by 0.1 s while the gate file exists (a test-only callback, ``callbacks=[pace_here:hook]``). Returns
    the gate, the store (keep it: it holds the endpoint's port) and a function that starts node RANK's launcher."""
    from torch.distributed import TCPStore

    (tmp_path / "pace_here.py").write_text(_PACE)
    gate = tmp_path / "paced"
    gate.write_text("")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    argv = [sys.executable, "-m", "multigpu", *workload, "callbacks=[pace_here:hook]", "--nnodes", "1:2",
            "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
            "--rdzv-conf", "is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1",
            "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MULTIGPU_RDZV_SECRET": "0123456789abcdef0123",
           "PACE_GATE": str(gate),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}

    def node(rank: int) -> subprocess.Popen:
        return subprocess.Popen([*argv, "--node-rank", str(rank)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    return gate, store, node


def _lose_and_rejoin(tmp_path, workload: list[str], run) -> tuple[list[subprocess.Popen], list[tuple[str, str]]]:
    """``multigpu WORKLOAD --nnodes 1:2`` on two loopback nodes: once a checkpoint of 2 ranks is on disk node 1's
    launcher is SIGKILLed; once the job has resized to 1 rank a new node 1 joins; once it has grown back the job
    runs to its end. Each step sleeps 0.1 s until then (a test-only callback, ``callbacks=[pace_here:hook]``)
    so the job cannot end before it has been through both. Returns the launchers (node 0, the lost node 1, the
    new node 1) and their (stdout, stderr)."""
    from multigpu.runtime.context import read_resizes

    gate, store, node = _paced_launchers(tmp_path, workload, run)

    def wait_for(what: str, done) -> None:
        deadline = time.monotonic() + 120
        while not done():
            alive = [p.poll() is None for p in procs if p is not procs[1]]
            assert time.monotonic() < deadline and all(alive), (what, [p.communicate(timeout=30) for p in procs])
            time.sleep(0.2)

    procs = [node(0), node(1)]
    try:
        wait_for("a checkpoint of 2 ranks", lambda: any(json.loads(m.read_text()).get("world_size") == 2
                                                       for m in run.glob("checkpoints/step_*/manifest.json")))
        time.sleep(1)
        procs[1].kill()  # node 1's launcher, as a lost machine: without a word
        procs[1].wait()
        wait_for("the resize to 1 rank", lambda: len(read_resizes(run)) >= 1)
        procs.append(node(1))  # the node comes back (a new launcher, the same rendezvous and run folder)
        wait_for("the resize back to 2 ranks", lambda: len(read_resizes(run)) >= 2)
        gate.unlink()
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    return procs, outputs


def _lost_line(err: str, workload: str) -> None:
    lost = [line for line in err.splitlines() if "was lost" in line]
    assert len(lost) == 1 and re.fullmatch(
        r"multigpu: node 1 \(.+\) \(rank 1\) was lost: its launcher sent no heartbeat for 3s .*; last step finished: "
        r"rank 0: \d+, rank 1: \d+; the job goes on with the nodes left \(--nnodes 1:2\)", lost[0]), (workload, err)


@pytest.mark.fault
def test_an_elastic_sim_job_loses_a_node_gets_it_back_and_ends_with_the_agents_of_an_uninterrupted_run(tmp_path):
    run = tmp_path / "run"
    steps = 400
    sim = _sir(steps, 10, "keep_last=50")
    procs, outputs = _lose_and_rejoin(tmp_path, sim, run)
    (out, err), (_, err_new) = outputs[0], outputs[2]
    assert procs[0].returncode == 0 and procs[2].returncode == 0, (err, err_new)
    assert "error:" not in err_new, err_new
    _lost_line(err, "sim")
    said = re.findall(r"multigpu sim: resized from (\d) to (\d) rank\(s\) at step (\d+): the state loaded equals the "
                      r"saved one, bit for bit \(digest ([0-9a-f]{16}-3001)\)", out)
    assert [(int(a), int(b)) for a, b, _, _ in said] == [(2, 1), (1, 2)], out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["final_step"]) == (2, steps), summary
    records = summary["resizes"]
    _records_as_said(records, said, "agents", "state_digest")
    assert records[0]["step"] < records[1]["step"] < steps
    assert [json.loads(line) for line in (run / "resizes.jsonl").read_text().splitlines()] == records

    # the job ends where an uninterrupted run on one rank ends: the agents are split-independent, and so is
    # every resume (this process, no launcher)
    from multigpu.config import load_config
    from multigpu.sim.checkpoint import state_digest
    from multigpu.sim.config import SimConfig
    from multigpu.sim.engine import SimEngine

    cfg = load_config(SimConfig, ROOT / "src/multigpu/presets/sir.yaml",
                      ["agents=3001", "grid=[30,30]", f"steps={steps}", "compile=false", "plot=false"])
    engine = SimEngine(cfg)
    engine.run()
    assert summary["state_digest"] == state_digest(engine)


@pytest.mark.fault
def test_a_node_that_rejoins_before_the_smaller_group_wrote_a_checkpoint_is_recorded_as_a_resize_too(tmp_path):
    """The lost node comes back while the 1-rank group has not yet written a checkpoint: the group re-forms at 2
    ranks from the same 2-rank checkpoint. Its size changed (1 -> 2) with no resize record: the record compared
    the checkpoint's world size (2) with the new group's (2). It compares with the size the run last ran at."""
    run = tmp_path / "run"
    steps = 400
    sim = _sir(steps, 100, "keep_last=50")
    procs, outputs = _lose_and_rejoin(tmp_path, sim, run)
    (out, err), (_, err_new) = outputs[0], outputs[2]
    assert procs[0].returncode == 0 and procs[2].returncode == 0, (err, err_new)
    said = re.findall(r"multigpu sim: resized from (\d) to (\d) rank\(s\) at step (\d+): the state loaded equals the "
                      r"saved one, bit for bit \(digest ([0-9a-f]{16}-3001)\)", out)
    assert [(int(a), int(b), int(s)) for a, b, s, _ in said] == [(2, 1, 100), (1, 2, 100)], out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["final_step"]) == (2, steps), summary
    records = summary["resizes"]
    assert [(r["from_ranks"], r["to_ranks"], r["step"]) for r in records] == [(2, 1, 100), (1, 2, 100)], records
    assert all(r["check"]["equal"] and r["check"]["bit_exact"] for r in records), records


def _records_as_said(records: list[dict], said: list[tuple], part: str, digest_key: str) -> list[dict]:
    """Each resize record is what its line said (from, to, step, digest), its check bit-exact over ``part``, and
    its checkpoint's manifest holds that digest (``meta[digest_key]``) at that step. Returns the manifests."""
    assert [(r["from_ranks"], r["to_ranks"], r["step"]) for r in records] == [(int(a), int(b), int(s))
                                                                                for a, b, s, _ in said]
    manifests = []
    for entry, (*_, digest) in zip(records, said, strict=True):
        check = entry["check"]
        assert check["equal"] and check["bit_exact"] and check["parts"] == [part], entry
        assert check["saved_digest"] == check["loaded_digest"] == digest, entry
        manifest = json.loads((Path(entry["checkpoint"]) / "manifest.json").read_text())
        assert manifest["meta"][digest_key] == digest and manifest["step"] == entry["step"], manifest
        manifests.append(manifest)
    return manifests


@pytest.mark.fault
def test_an_elastic_rl_job_loses_a_node_gets_it_back_with_the_same_environments_re_split(tmp_path):
    run = tmp_path / "run"
    updates = 300
    rl = ["rl", "-f", "ppo-cartpole", "num_envs=8", "num_steps=8", f"total_env_steps={8 * 8 * updates}",
          "target_return=null", "num_minibatches=2", "update_epochs=1", "checkpoint_every=5", "keep_last=100",
          "log_every=100"]
    procs, outputs = _lose_and_rejoin(tmp_path, rl, run)
    (out, err), (_, err_new) = outputs[0], outputs[2]
    assert procs[0].returncode == 0 and procs[2].returncode == 0, (err, err_new)
    _lost_line(err, "rl")
    said = re.findall(r"multigpu rl: resized from (\d) to (\d) rank\(s\) at update (\d+): the state loaded equals the "
                      r"saved one, bit for bit \(digest ([0-9a-f]{16}-8)\)", out)
    assert [(int(a), int(b)) for a, b, _, _ in said] == [(2, 1), (1, 2)], out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["rl"]["world_size"], summary["rl"]["updates"]) == (2, updates), summary["rl"]
    records = summary["resizes"]
    for entry, manifest in zip(records, _records_as_said(records, said, "envs", "env_digest"), strict=True):
        # the checkpoint's environments were written by the size the record says (every rank's, in id order)
        assert manifest["world_size"] == entry["from_ranks"]
    assert records[0]["step"] < records[1]["step"] < updates


@pytest.mark.fault
def test_losing_node_0_which_hosts_the_rendezvous_store_ends_an_elastic_job_in_one_line(tmp_path):
    """torch's c10d store lives in node 0's launcher: without it no node can re-form the job, elastic or not.
    Before, the survivor ended with "error: the launcher could not start the job: The connection to the C10d
    store has failed", which named neither node 0 nor why. Here node 0 hosts the store itself (a port held
    bound but not listening until its launcher takes it, as the scheduler tests do: no fixed port)."""
    import socket

    (tmp_path / "pace_here.py").write_text(_PACE)
    gate = tmp_path / "paced"
    gate.write_text("")  # the job runs until it is lost
    run = tmp_path / "run"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    argv = [sys.executable, "-m", "multigpu", "sim", "-f", "sir", "--agents", "3001", "grid=[30,30]", "--steps=400",
            "--checkpoint-every", "10", "compile=false", "plot=false", "callbacks=[pace_here:hook]", "--nnodes", "1:2",
            "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1", "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MULTIGPU_RDZV_SECRET": "0123456789abcdef0123",
           "PACE_GATE": str(gate),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([*argv, "--node-rank", str(r)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        while not any(json.loads(m.read_text()).get("world_size") == 2
                      for m in run.glob("checkpoints/step_*/manifest.json")):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate(timeout=30) for p in procs]
            time.sleep(0.2)
        sock.close()
        time.sleep(1)
        procs[0].kill()  # node 0's launcher, and the store in it
        procs[0].wait()
        lost = time.monotonic()
        _, err = procs[1].communicate(timeout=60)
        took = time.monotonic() - lost
    finally:
        sock.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[1].returncode == 1, err
    said = [line for line in err.splitlines() if line.startswith(("error:", "multigpu: node"))]
    assert len(said) == 1 and re.fullmatch(
        rf"error: node 0 \(.+\) was lost, and with it the rendezvous store its launcher hosts at {endpoint} \(torch's "
        r"c10d store lives on node 0\): the job cannot go on without it, also with --nnodes 1:2; last step finished: "
        r"rank 0: \d+, rank 1: \d+", said[0]), err
    assert err.rstrip().endswith(said[0]) and took < 30, (took, err[-2000:])  # the last line, within seconds


@pytest.mark.fault
def test_a_node_that_arrives_after_the_job_ended_is_told_so_and_exits_within_seconds(tmp_path):
    """An elastic job of two nodes ends (node 0's launcher, which hosts the rendezvous store, exits with it); a node
    started afterwards for the same job waited for the store, silently, for the whole join timeout (5+ minutes).
    Its run folder holds the ended run's summary.json: it says so in one line and exits, within seconds."""
    import socket

    run = tmp_path / "run"
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # node 0's store port, held until its launcher takes it (no fixed port)
    endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
    argv = [sys.executable, "-m", "multigpu", "sim", "-f", "sir", "--agents", "3001", "grid=[30,30]", "--steps=10",
            "compile=false", "plot=false", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
            "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1", "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MULTIGPU_RDZV_SECRET": "0123456789abcdef0123",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([*argv, "--node-rank", str(r)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        time.sleep(1)
        sock.close()
        outputs = [p.communicate(timeout=120) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], outputs
        started = time.monotonic()
        late = subprocess.run([*argv, "--node-rank", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=60)
        took = time.monotonic() - started
    finally:
        sock.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert late.returncode == 2 and took < 20, (took, late.stderr[-2000:])
    line = late.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: node 1 arrived after the job in {run} had ended (its summary.json, written "), line
    assert "nothing to join; valid: --resume auto on every node to continue it, or a new --run-dir" in line, line


@pytest.mark.fault
def test_a_restart_after_a_node_is_killed_and_started_again_names_that_node_not_the_survivors_gloo_error(tmp_path):
    """Node 1's launcher killed and started again at once: the job re-forms at 2 ranks. The restart record named
    only rank 0's gloo error ("lost a peer", a consequence); its cause, node 1, is named now, in the record and in
    the line, whether node 1 was found lost or its new launcher's heartbeat began again first."""
    from multigpu.runtime.context import read_restarts

    run = tmp_path / "run"
    gate, store, node = _paced_launchers(tmp_path, _sir(200, 10), run)

    procs = [node(0), node(1)]
    try:
        deadline = time.monotonic() + 120
        while not any(json.loads(m.read_text()).get("world_size") == 2
                      for m in run.glob("checkpoints/step_*/manifest.json")):
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate(timeout=30)
            time.sleep(0.2)
        time.sleep(1)
        procs[1].kill()  # node 1's launcher, then a new one at once (a scheduler's restart)
        procs[1].wait()
        procs.append(node(1))
        while not read_restarts(run):
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate(timeout=30)
            time.sleep(0.2)
        time.sleep(3)
        gate.unlink()
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    (_, err), (_, err_new) = outputs[0], outputs[2]
    assert procs[0].returncode == 0 and procs[2].returncode == 0, (err, err_new)
    records = json.loads((run / "summary.json").read_text())["restarts"]
    first = [r for r in records if r["restart"] == 1]
    # node 1 named as the cause (found lost, or its new launcher's heartbeat seen first), never rank 0's gloo error
    assert first and all(r["node"] == 1 and "rank" not in r for r in first), records
    assert all(re.match(r"node 1 \(.+\) (\(rank 1\) )?(was lost|started again)", r["cause"]) for r in first), records
    said = [line for line in err.splitlines() if "restarting the worker group" in line and "restart 1 of" in line]
    assert said and all("(the cause: node 1 (" in line for line in said), err
    assert not [line for line in err.splitlines() if re.search(r"rank 0 \(local rank 0 on node 0, .*\) died", line)]
