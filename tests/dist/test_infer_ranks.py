"""sliding_window on real gloo ranks: every window evaluated exactly once, output bitwise equal to one process.

These pin the two promises of the split: no window is dropped or repeated (a
DistributedSampler pads 121 windows to 124 by repeating three), and the result
does not depend on the number of ranks (overlaps added in window order).
"""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import multigpu as mg
from multigpu.infer import WindowPlan, sliding_window
from multigpu.infer.models import upsample2x
from multigpu.infer.windows import as_tuple
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist


class _Recorder(torch.nn.Module):
    """Wraps a model and records a fingerprint of every window it evaluates."""

    def __init__(self, model):
        super().__init__()
        self.model, self.seen = model, []

    def forward(self, x):
        self.seen.extend(hashlib.sha1(w.contiguous().numpy().tobytes()).hexdigest() for w in x)
        return self.model(x)


def _net(in_ch, out_ch, dims):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d
    return torch.nn.Sequential(conv(in_ch, 4, 3, padding=1), torch.nn.Tanh(), conv(4, out_ch, 3, padding=1)).eval()


def _cases():
    g = torch.Generator().manual_seed(5)
    return {
        # three images, one smaller than the roi in both dims; 47 windows in batches of 7 = 7 batches
        "sizes": dict(inputs=[torch.randn(2, 3, 70, 90, generator=g), torch.randn(1, 3, 20, 25, generator=g),
                              torch.randn(1, 3, 150, 41, generator=g)],
                      model=lambda: _net(3, 2, 2), roi=32, overlap=0.4, batch_size=7, blend="constant"),
        # x2 output and overlap 0.75: a voxel is covered by up to 16 windows, across several ranks
        "x2": dict(inputs=torch.rand(1, 3, 45, 61, generator=g), model=upsample2x, roi=(16, 24),
                   overlap=0.75, batch_size=2, blend="gaussian"),
        # crop: every voxel from exactly one window (x2 output, uneven overlaps at the image's end)
        "crop": dict(inputs=torch.rand(1, 3, 45, 61, generator=g), model=upsample2x, roi=(16, 24),
                     overlap=0.5, batch_size=3, blend="crop"),
        # 3-D, batch 1, replicate padding in depth
        "3d": dict(inputs=torch.randn(1, 2, 6, 20, 17, generator=g), model=lambda: _net(2, 3, 3),
                   roi=(8, 8, 8), overlap=(0.0, 0.5, 0.3), batch_size=1, blend="gaussian", pad_mode="replicate"),
        # two batches: on 3 ranks the last one has no window (it sends no voxel and spills nothing)
        "few": dict(inputs=torch.rand(1, 1, 40, 30, generator=g), model=lambda: _net(1, 2, 2), roi=16,
                    overlap=0.25, batch_size=5, blend="gaussian"),
    }


def _run(case):
    case = dict(case)
    model = _Recorder(case.pop("model")())
    out = sliding_window(case.pop("inputs"), model, progress=False, **case)
    return out, model.seen


def _ranks_body():
    return {name: _run(case) for name, case in _cases().items()} | {"rank": mg.rank()}


def _num_windows(case):
    inputs = case["inputs"] if isinstance(case["inputs"], list) else [case["inputs"]]
    ndim = inputs[0].dim() - 2
    sizes = [img.shape[1:] for t in inputs for img in t]
    return WindowPlan(sizes, as_tuple(case["roi"], ndim, "roi"), as_tuple(case["overlap"], ndim, "overlap"))


@pytest.mark.parametrize("world_size", [3, 2])
def test_every_window_once_and_output_identical_to_one_process(world_size):
    results = run_on_ranks(_ranks_body, world_size, timeout_s=150)
    for name, case in _cases().items():
        reference, reference_seen = _run(case)
        plan = _num_windows(case)
        assert len(reference_seen) == plan.num_windows == len(set(reference_seen))
        # exactly once: the ranks' evaluations, counted together, are each window one time
        counts = Counter(h for r in results for h in r[name][1])
        assert counts == Counter(reference_seen), f"{name}: windows missing or repeated across ranks"
        bounds = plan.rank_bounds(case["batch_size"], world_size)
        assert [len(r[name][1]) for r in results] == [stop - start for start, stop in bounds]
        # rank 0 has the output, bitwise equal to one process; the others get None
        out = results[0][name][0]
        assert all(r[name][0] is None for r in results[1:])
        if isinstance(reference, list):
            assert len(out) == len(reference) and all(torch.equal(a, b) for a, b in zip(out, reference, strict=True))
        else:
            assert torch.equal(out, reference), f"{name}: max diff {(out - reference).abs().max().item()}"
    # the awkward part is really awkward: windows and batches do not divide by the ranks
    sizes = _num_windows(_cases()["sizes"])
    assert sizes.num_windows == 47 and len(sizes.rank_bounds(7, world_size)) == world_size
    assert sizes.num_windows % world_size and -(-sizes.num_windows // 7) % world_size


def _group_of_one_body():
    """One rank with a real group (run_on_ranks(..., group_of_one=True)): the multi-rank exchange path."""
    from multigpu.infer import stats
    from multigpu.runtime import collectives, group

    env = mg.get_env()
    exchange = group.exchange_group()
    calls = Counter()
    real_isend, real_recv = collectives.isend, collectives.recv

    def isend(*args, **kwargs):
        calls["isend"] += 1
        return real_isend(*args, **kwargs)

    def recv(*args, **kwargs):
        calls["recv"] += 1
        return real_recv(*args, **kwargs)

    collectives.isend, collectives.recv = isend, recv
    try:
        outputs = {name: _run(case)[0] for name, case in _cases().items()}
    finally:
        collectives.isend, collectives.recv = real_isend, real_recv
    reduced = mg.all_reduce(torch.tensor([2.0]))  # checked: its shape exchange runs over the group too
    mg.barrier()
    return {"backend": env.backend, "world_size": env.world_size, "loopback": isinstance(exchange, group.Loopback),
            "outputs": outputs, "calls": dict(calls), "owned": stats.EXCHANGE_STATS.get("owned", 0),
            "reduced": reduced.tolist()}


def test_group_of_one_takes_the_multi_rank_exchange_path_with_the_same_bits():
    """The harness's group of one (a real gloo group at world size 1) runs the point-to-point exchange that
    the last rank uses on N ranks, sending to itself over a loopback on the receiver thread; without the
    switch a single rank exchanges nothing. Output: the same bits as one process without a group."""
    (got,) = run_on_ranks(_group_of_one_body, 1, group_of_one=True, timeout_s=120)
    assert got["backend"] == "gloo" and got["world_size"] == 1 and got["loopback"]
    assert got["calls"]["isend"] > 0 and got["calls"]["recv"] > 0  # headers, then the voxels, to itself
    assert got["owned"] > 0 and got["reduced"] == [2.0]
    for name, case in _cases().items():
        alone, _ = _run(case)
        ours, theirs = (x if isinstance(x, list) else [x] for x in (got["outputs"][name], alone))
        assert len(ours) == len(theirs) and all(torch.equal(a, b) for a, b in zip(ours, theirs)), name
    with pytest.raises(ValueError, match="needs world_size=1"):
        run_on_ranks(_group_of_one_body, 2, group_of_one=True)


def _as_nccl_job_body():
    """Rank r of a gloo job that multigpu takes for an NCCL one (its env says nccl): the exchange group is made."""
    import dataclasses
    import threading

    from multigpu.runtime import collectives, group

    group._ENV = dataclasses.replace(mg.get_env(), backend="nccl")
    exchange = group.exchange_group()  # every rank, first: a gloo group beside the (pretended) NCCL one
    seen = []
    real_isend, real_recv = collectives.isend, collectives.recv

    def isend(tensor, dst, **kwargs):
        seen.append(("isend", kwargs.get("pg") is exchange, tensor.device.type, threading.current_thread().name))
        return real_isend(tensor, dst, **kwargs)

    def recv(src, **kwargs):
        out = real_recv(src, **kwargs)
        seen.append(("recv", kwargs.get("pg") is exchange, out.device.type, threading.current_thread().name))
        return out

    collectives.isend, collectives.recv = isend, recv
    try:
        out = _run(_cases()["few"])[0]
    finally:
        collectives.isend, collectives.recv = real_isend, real_recv
    return {"out": out, "seen": seen, "gloo": dist.get_backend(exchange) == "gloo"}


def test_on_nccl_jobs_the_receiver_thread_takes_cpu_tensors_over_the_gloo_exchange_group():
    """On an NCCL job the last rank's windows and voxels go point to point as CPU tensors over a gloo group
    made beside NCCL (``group.exchange_group``), received on rank 0's receiver thread: a receive over NCCL
    would make the CUDA stream that the main thread's kernels share wait until the last rank sends. Two CPU
    ranks whose runtime says NCCL (the group below is gloo, as a CPU machine has): every send and receive is
    over the exchange group, of CPU tensors, the receives on the receiver thread; the output is one process's."""
    results = run_on_ranks(_as_nccl_job_body, 2, timeout_s=120)
    alone, _ = _run(_cases()["few"])
    assert torch.equal(results[0]["out"], alone) and results[1]["out"] is None
    sends, receives = results[1]["seen"], results[0]["seen"]
    assert sends and receives and all(r["gloo"] for r in results)
    assert {(kind, over, device) for kind, over, device, _ in sends + receives} == {("isend", True, "cpu"),
                                                                                  ("recv", True, "cpu")}
    assert {thread for _, _, _, thread in receives} == {"multigpu-infer-receive"}
