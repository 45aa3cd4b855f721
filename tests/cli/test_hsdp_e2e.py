"""`multigpu train --strategy hsdp` end to end on 2 loopback "nodes" × 2 CPU ranks.

Two launchers meet at one rendezvous endpoint, as two machines would; the shard group defaults to the ranks
per node, so each parameter is sharded over a node's 2 ranks and replicated across the 2 nodes. One test,
three launches of the same tiny job (4 steps of 8 samples, a checkpoint every 2 steps, the export at the end):

1. hsdp on 2 nodes × 2 ranks, uninterrupted: its losses and exported weights equal those of
2. ddp on 1 node × 2 ranks (the same global batches) within fp32 tolerance;
3. hsdp on the same 2 × 2 layout, resumed from run 1's checkpoint of step 2 (DCP shards on the 2-D mesh):
   steps 3 and 4 and the export are run 1's bit for bit.

The same kind of checkpoint resumed on other layouts (2 ranks under ddp, fsdp, and hsdp as 1 replica × 2)
is tested through the Trainer in tests/dist/test_hsdp.py (fewer processes than more launches here).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.e2e

JOB = ["model.kwargs.n_layer=1", "model.kwargs.n_head=2", "model.kwargs.n_embd=16", "block_size=16",
       "data.kwargs.max_chars=20000", "global_batch_size=8", "steps=4", "checkpoint_every=2", "keep_last=5",
       "warmup_steps=1", "eval_every=0", "eval_batches=1", "log_every=1", "sample_chars=0", "prefetch=0", "logger=[]",
       "--export", "safetensors"]
ENV = {"OMP_NUM_THREADS": "1", "MULTIGPU_RDZV_SECRET": "0123456789abcdef0123"}
"""One thread per rank; several nodes sign the rendezvous state with a secret they share."""


def _two_nodes(run_dir, *extra: str) -> str:
    """Two launchers (node_rank 0 and 1, 2 ranks each) on loopback; returns node 0's stdout."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # we keep the socket: no port race
    base = [sys.executable, "-m", "multigpu", "train", "--nnodes", "2", "--nproc-per-node", "2", "--cpu",
            "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf", "is_host=false", "--run-dir", str(run_dir),
            "--strategy", "hsdp", *JOB, *extra]
    procs = [subprocess.Popen([*base, "--node-rank", str(r)], cwd=ROOT, env={**os.environ, **ENV},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:  # a launcher that hung: it and its ranks (its own session)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    return "".join(out for out, _ in outs)


def _one_node(run_dir, *extra: str) -> str:
    out = run_cli("train", "--nproc-per-node", "2", "--cpu", "--run-dir", str(run_dir), *JOB, *extra, env=ENV,
                  timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _losses(run_dir) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def _weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        diff = (value - got[key]).abs().max().item()
        assert torch.allclose(got[key], value, rtol=1e-5, atol=1e-6), f"{what}: {key} differs by {diff:.3g}"


def test_hsdp_on_two_nodes_trains_like_ddp_and_resumes_bit_identically_on_two_nodes(tmp_path):
    hsdp, ddp, same = (tmp_path / name for name in ("hsdp", "ddp", "same"))
    out = _two_nodes(hsdp)
    # the shard group defaults to the ranks per node: 2 replicas (one per node) of 2 shards
    assert "training state per rank (planned, strategy hsdp: sharded over 2 ranks of a replica, 2 replicas)" in out
    step2 = hsdp / "checkpoints" / "step_00000002"
    assert {".metadata", "manifest.json", "state.pt"} < {p.name for p in step2.iterdir()}  # DCP shards
    # what bench --predict reads: the layout, and the collectives counted on the groups of the 2-D mesh
    summary = json.loads((hsdp / "summary.json").read_text())
    assert summary["hsdp"] == {"shard_size": 2, "set": False}
    assert set(summary["traffic"]) == {"sharded_all_gather:shard", "reduce_scatter:shard", "all_reduce:replicate"}
    assert summary["traffic"]["all_reduce:replicate"] == summary["traffic"]["reduce_scatter:shard"]

    _one_node(ddp, "--strategy", "ddp")
    assert _losses(hsdp) == pytest.approx(_losses(ddp), rel=1e-5)
    assert sorted(_losses(hsdp)) == [1, 2, 3, 4]
    _assert_close(_weights(hsdp), _weights(ddp), "hsdp 2x2 vs ddp")

    out = _two_nodes(same, "--resume", str(step2))
    assert f"resuming from {step2}" in out and "resumed at step 2" in out
    assert _losses(same) == {k: v for k, v in _losses(hsdp).items() if k > 2}  # bit for bit
    whole = _weights(hsdp)
    assert all(torch.equal(v, whole[k]) for k, v in _weights(same).items()), "2x2 -> 2x2: not bit-identical"
