"""Sliding-window inference on CUDA: equal to one CPU rank within float tolerance, to MONAI on the same GPU,
and bit for bit the same on 2 GPU ranks as on one (the runner's guarantee, with the model on a GPU).

TF32 is off for the fp32 comparisons (cuDNN would otherwise round convolutions to 10-bit mantissas).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import multigpu as mg
from multigpu.infer import sliding_window
from multigpu.runtime.context import RunContext
from multigpu.testing import requires_gpus, run_on_ranks

pytestmark = pytest.mark.gpu

ROI, OVERLAP, BATCH, BLEND = 96, 0.25, 8, "gaussian"


def make_model(device: str | torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(16, 3, 3, padding=1)).eval().to(device)


def make_image() -> torch.Tensor:
    return torch.rand(1, 3, 333, 410, generator=torch.Generator().manual_seed(1))  # not a multiple of the stride


@contextlib.contextmanager
def no_tf32():
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def ours(device: str | torch.device, precision: str = "fp32") -> torch.Tensor | None:
    return sliding_window(make_image(), make_model(device), ROI, OVERLAP, BATCH, BLEND, precision=precision,
                          progress=False)


def _ranks_body() -> torch.Tensor | None:
    with no_tf32():
        return ours(mg.device())


@requires_gpus(1)
def test_cuda_output_matches_one_cpu_rank_and_two_gpu_ranks():
    with no_tf32():
        cuda, cpu = ours("cuda"), ours("cpu")
    assert cuda.device.type == "cpu" and cuda.shape == (1, 3, 333, 410)
    assert torch.allclose(cuda, cpu, rtol=1e-4, atol=1e-5), (cuda - cpu).abs().max().item()
    placement = ({"env": {"CUDA_VISIBLE_DEVICES": "0,1"}} if torch.cuda.device_count() >= 2 else  # else --share-gpus
                 {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "ctx": RunContext(isolated=True, pg_backend="gloo")})
    two = run_on_ranks(_ranks_body, 2, backend="cuda", **placement, timeout_s=300)[0]
    assert torch.equal(two, cuda), (two - cuda).abs().max().item()


@requires_gpus(1)
def test_cuda_output_matches_monai_on_the_same_gpu():
    inferers = pytest.importorskip("monai.inferers")
    model = make_model("cuda")
    with no_tf32(), torch.inference_mode():
        theirs = inferers.sliding_window_inference(make_image().cuda(), ROI, BATCH, model, OVERLAP, BLEND).cpu()
        mine = ours("cuda")
    assert torch.allclose(mine, theirs, rtol=1e-4, atol=1e-5), (mine - theirs).abs().max().item()
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        theirs16 = inferers.sliding_window_inference(make_image().cuda(), ROI, BATCH, model, OVERLAP, BLEND).float().cpu()
    mine16 = ours("cuda", precision="bf16")
    scale = theirs.abs().max().item()
    assert (mine16 - theirs16).abs().max().item() < 1e-2 * scale  # the same bf16 windows, blended in fp32 each


def _group_of_one_body() -> dict:
    """One GPU rank in a real NCCL group (run_on_ranks(..., group_of_one=True)): the multi-rank code paths."""
    from multigpu.runtime import group

    env = mg.get_env()
    x = torch.arange(6.0, device=env.device).reshape(2, 3)
    reduced = mg.all_reduce(x.clone())  # shapes over gloo, data over NCCL
    gathered = mg.gather(x, dst=0)
    broadcast = mg.broadcast(x.clone())
    with no_tf32():
        out = ours(env.device)
    return {"backend": env.backend, "loopback": isinstance(group.exchange_group(), group.Loopback),
            "devices": {t.device.type for t in (reduced, gathered, broadcast)},
            "equal": bool(torch.equal(reduced, x) and torch.equal(gathered, x) and torch.equal(broadcast, x)),
            "out": out}


@requires_gpus(1)
def test_nccl_group_of_one_runs_the_exchange_and_checked_collectives():
    """On one GPU the harness's group of one creates NCCL at world size 1: checked collectives on CUDA tensors
    (metadata over the gloo side group) and the inference exchange (a loopback on the receiver thread) run,
    and the output is the same bits as one process on the same GPU without a group."""
    with no_tf32():
        alone = ours("cuda")
    (got,) = run_on_ranks(_group_of_one_body, 1, backend="cuda", group_of_one=True,
                          env={"CUDA_VISIBLE_DEVICES": "0"}, timeout_s=300)
    assert got["backend"] == "nccl" and got["loopback"] and got["devices"] == {"cuda"} and got["equal"]
    assert torch.equal(got["out"], alone), (got["out"] - alone).abs().max().item()
