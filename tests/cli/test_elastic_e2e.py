"""An elastic training job (``--nnodes 1:2``) on two loopback nodes loses one (its launcher SIGKILLed) and goes on.

One launch, several assertions: the survivor names the lost node in one line, torch's agent re-forms the job at
the smaller size, the run resumes its newest checkpoint re-split for one rank (keeping the global batch), the
resize is recorded (from 2 to 1 ranks, the step, the check that the state loaded is the state saved: bit-exact
for ddp) in the run folder and in summary.json, and the job finishes every step. The test holds the rendezvous
store itself (is_host=false), as the other two-node tests do, so no port is chosen by hand.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.e2e

_TINY = ["model.kwargs.n_layer=1", "model.kwargs.n_head=2", "model.kwargs.n_embd=16", "block_size=16",
         "data.kwargs.max_chars=20000", "batch_size=4", "checkpoint_every=2", "keep_last=3", "warmup_steps=1",
         "eval_every=0", "eval_batches=1", "log_every=0", "sample_chars=0", "prefetch=0", "logger=[]"]


@pytest.mark.fault
def test_an_elastic_train_job_loses_a_node_and_finishes_at_the_smaller_size_with_its_resize_record(tmp_path):
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run = tmp_path / "run"
    steps = 400
    argv = [sys.executable, "-m", "multigpu", "train", "-f", "nano", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--rdzv-endpoint", f"127.0.0.1:{store.port}",
            "--rdzv-conf", "is_host=false,keep_alive_interval=1,keep_alive_max_attempt=3,last_call_timeout=1",
            "--run-dir", str(run), *_TINY, f"steps={steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MULTIGPU_RDZV_SECRET": "0123456789abcdef0123"}
    procs = [subprocess.Popen([*argv, "--node-rank", str(r)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        deadline = time.monotonic() + 120
        # the job runs on both nodes: a checkpoint written by 2 ranks (then some steps, heard of by both nodes)
        while not any(json.loads(m.read_text()).get("world_size") == 2
                      for m in run.glob("checkpoints/step_*/manifest.json")):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate(timeout=30) for p in procs]
            time.sleep(0.2)
        time.sleep(2)
        procs[1].kill()  # node 1's launcher, as a lost machine: without a word
        out, err = procs[0].communicate(timeout=180)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert procs[0].returncode == 0, err
    lost = [line for line in err.splitlines() if "was lost" in line]
    assert len(lost) == 1 and re.fullmatch(
        r"multigpu: node 1 \(.+\) \(rank 1\) was lost: its launcher sent no heartbeat for 3s .*; last step finished: "
        r"rank 0: \d+, rank 1: \d+; the job goes on with the nodes left \(--nnodes 1:2\)", lost[0]), err
    resized = re.search(r"multigpu train: resized from 2 to 1 rank\(s\) at step (\d+): the state loaded equals the "
                        r"saved one \(max relative difference 0\.0e\+00, tolerance 1e-09\)", out)
    assert resized, out
    assert "keeps the global batch of 8 samples per step" in out
    assert f"done: step {steps}," in out
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["final_step"], summary["effective_batch"]) == (1, steps, 8)
    (record,) = summary["resizes"]
    assert (record["from_ranks"], record["to_ranks"], record["step"]) == (2, 1, int(resized[1]))
    assert record["check"]["equal"] and record["check"]["bit_exact"]
    assert record["checkpoint"].endswith(f"step_{int(resized[1]):08d}")
    assert [json.loads(line) for line in (run / "resizes.jsonl").read_text().splitlines()] == [record]
