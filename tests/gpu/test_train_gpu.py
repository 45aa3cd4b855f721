"""Training on CUDA: the nano GPT in fp32, bf16 and fp16 (grad scaler), DDP over every sync backend, hybrid jobs.

These pin what the CPU tests cannot: autocast and the grad scaler on a GPU make
the loss fall; the ``cpu`` sync backend, which stages CUDA gradients through
host memory, gives what NCCL (2 GPUs) or gloo (2 ranks sharing one GPU) gives;
and a job of GPU and CPU ranks (``--allow-cpu-ranks``), or of CUDA ranks at
all, computes the gradients 2 CPU ranks compute and ends where they end, within what Adam makes of float
rounding (TF32 off; see ``assert_same_training``).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import multigpu as mg
from multigpu.runtime.context import RunContext
from multigpu.testing import requires_gpus, run_on_ranks
from multigpu.train import ModelConfig, TrainConfig, Trainer, make_optimizer, make_scheduler
from multigpu.train.data import VOCAB, CharDataset, encode
from multigpu.train.model import GPT

pytestmark = pytest.mark.gpu

TINY = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
EXACT = TrainConfig(steps=4, global_batch_size=8, lr=3e-3, warmup_steps=1, eval_every=0, log_every=0,
                    checkpoint_every=0, prefetch=0, tf32=False)
"""For comparisons: fp32, no TF32, random tokens."""
LEARN = dataclasses.replace(EXACT, steps=30, lr=1e-2, prefetch=2)
"""For a falling loss: a repeated text the model learns in a few steps."""
SGD = {"lr": 0.1, "warmup_steps": 0, "grad_clip": 0.0}
"""With plain SGD (:func:`assert_same_sgd`): no clipping, which would scale a summed gradient back to an average's."""

# placements of 2 spawned ranks (run_on_ranks' env and run context, as the launcher would give them):
# NCCL on 2 GPUs, gloo sharing GPU 0 (--share-gpus), hybrid GPU + CPU (--allow-cpu-ranks)
NCCL_2 = {"env": {"CUDA_VISIBLE_DEVICES": "0,1"}}
SHARED_1 = {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "run": RunContext(isolated=True, pg_backend="gloo")}
HYBRID = {"env": {"CUDA_VISIBLE_DEVICES": "0"}, "run": RunContext(allow_cpu_ranks=True, hybrid=True)}


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def random_tokens() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, len(VOCAB), (32 * 64 + 1,), generator=gen, dtype=torch.uint8)


def text_tokens() -> torch.Tensor:
    return encode("def add(a, b):\n    return a + b\n\n" * 200)


def train(cfg: TrainConfig, tokens: torch.Tensor, *, sgd: bool = False) -> dict:
    """Train the tiny GPT with the Trainer on every rank of the current job (or alone); figures on the CPU.
    ``sgd``: plain SGD instead of AdamW, whose update is the averaged gradient times lr (see :func:`assert_same_sgd`)."""
    torch.manual_seed(0)  # identical initial weights on every rank
    model = GPT(TINY, len(VOCAB))
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr) if sgd else make_optimizer(model, cfg)
    trainer = Trainer(model, optimizer, CharDataset(tokens, TINY.block_size), config=cfg,
                      scheduler=make_scheduler(optimizer, cfg), run_dir=None)
    trainer.setup()
    grads: dict = {}  # the first step's gradients as the optimizer applies them (averaged over the ranks, clipped)

    def first_gradients(*_) -> None:
        if not grads:
            grads.update({k: p.grad.detach().cpu().clone() for k, p in model.named_parameters() if p.grad is not None})

    optimizer.register_step_pre_hook(first_gradients)
    losses, norms = [], []
    for _ in range(cfg.steps):
        metrics = trainer.train_step()
        losses.append(float(metrics["loss"]))  # this rank's loss
        norms.append(float(metrics["grad_norm"]))  # the whole gradient's, before clipping
        trainer.step += 1
    trainer.close()
    return {"state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, "losses": losses,
            "grads": grads, "grad_norms": norms,
            "device": str(next(model.parameters()).device), "scaler": trainer.scaler.is_enabled(),
            "initial": initial}


def max_diff(a: dict, b: dict) -> tuple[str, float]:
    """The parameter that differs most between two state dicts, and by how much."""
    diffs = {k: (a[k].double() - b[k].double()).abs().max().item() for k in a}
    worst = max(diffs, key=diffs.get)
    return worst, diffs[worst]


def assert_close(a: dict, b: dict, what: str, rtol: float, atol: float) -> None:
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=rtol, atol=atol), f"{what}: {max_diff(a, b)}"


def assert_close_across_devices(a: dict, b: dict, what: str) -> None:
    """Two runs of ``EXACT`` on different devices (CUDA vs CPU kernels) end where Adam lets them.

    The kernels sum in different orders, so gradients differ by float rounding; Adam divides each gradient by its
    own running scale, so where a gradient is near zero that rounding moves the update by a visible share of the
    learning rate (the first GPU call, one H200: 3e-5 on a few elements after 4 steps at lr 3e-3). So: 99.9% of
    the elements within the tight tolerance (rtol 1e-4, atol 1e-5), and every element within 1% of the most Adam
    can move it (lr per step): a wrong gradient average (a sum, one rank's alone) moves almost every element
    further than both.
    """
    bound = 0.01 * EXACT.lr * EXACT.steps
    for key in a:
        diff = (a[key].double() - b[key].double()).abs()
        tight = diff <= 1e-5 + 1e-4 * b[key].double().abs()
        assert tight.double().mean().item() >= 0.999, (
            f"{what}: {key}: only {tight.double().mean().item():.2%} of the elements within rtol 1e-4, atol 1e-5")
        assert diff.max().item() <= bound, f"{what}: {key} differs by {diff.max().item():.2e} > {bound:.1e}"


def assert_same_training(a: dict, b: dict, what: str) -> None:
    """Two runs of ``EXACT`` (``train``'s results, on any devices) trained the same model on the same gradients.

    The gradients first: each step's norm before clipping (within 0.1%) and the first step's applied gradient
    (99.9% of the elements within rtol 1e-4, atol 1e-6). The weights alone cannot tell summed gradients from
    averaged ones: Adam divides each gradient by its own running scale, and where both runs are clipped they
    apply the same gradient (tests/unit/test_gpu_helpers_on_cpu.py shows both)."""
    for step, (x, y) in enumerate(zip(a["grad_norms"], b["grad_norms"], strict=True)):
        assert abs(x - y) <= 1e-3 * abs(y), f"{what}: gradient norm of step {step + 1}: {x:.6g} vs {y:.6g}"
    assert a["grads"].keys() == b["grads"].keys(), f"{what}: gradients of {sorted(a['grads'])} vs {sorted(b['grads'])}"
    for key, g in b["grads"].items():
        diff = (a["grads"][key].double() - g.double()).abs()
        tight = (diff <= 1e-6 + 1e-4 * g.double().abs()).double().mean().item()
        assert tight >= 0.999, f"{what}: the first step's gradient of {key}: only {tight:.2%} within rtol 1e-4, atol 1e-6"
    assert_close_across_devices(a["state"], b["state"], what)


def assert_same_sgd(a: dict, b: dict, what: str) -> None:
    """Two runs of ``EXACT`` with plain SGD (``sgd-*``) moved the weights by the same steps: each update is lr times
    the averaged gradient, so a gradient summed over 2 ranks instead of averaged moves them twice as far, which
    Adam would hide (it divides each gradient by its own running scale: x2 changes nothing). The movement from
    the initial weights agrees to 0.1% of its size over the whole model (CUDA and CPU kernels round differently,
    by far less), and in every tensor that moved to 1%; a sum (x2) or one rank's gradient alone misses both."""
    moved_a = {k: a["state"][k].double() - a["initial"][k].cpu().double() for k in a["state"]}
    moved_b = {k: b["state"][k].double() - b["initial"][k].cpu().double() for k in b["state"]}
    size = math.sqrt(sum(float(m.square().sum()) for m in moved_b.values()))
    apart = math.sqrt(sum(float((moved_a[k] - moved_b[k]).square().sum()) for k in moved_b))
    assert size > 0 and apart <= 1e-3 * size, f"{what}: the SGD steps differ by {apart / size:.2%} of their size"
    for key, m in moved_b.items():
        norm = float(m.norm())
        if norm > 1e-6:
            off = float((moved_a[key] - m).norm())
            assert off <= 0.01 * norm, f"{what}: {key}: the SGD steps differ by {off / norm:.2%}"


def loss_fell(losses: list[float]) -> bool:
    start, end = losses[0], sum(losses[-5:]) / 5
    return all(math.isfinite(v) for v in losses) and end < 0.6 * start


def variants(syncs: tuple[str, ...], precisions: tuple[str, ...]) -> dict:
    """Rank body: fp32 training with each sync backend, and a learning run in each mixed precision."""
    out = {f"fp32-{s}": train(dataclasses.replace(EXACT, sync_backend=s), random_tokens()) for s in syncs}
    out.update({f"sgd-{s}": train(dataclasses.replace(EXACT, sync_backend=s, **SGD),
                                  random_tokens(), sgd=True) for s in syncs})
    for p in precisions:
        out[p] = train(dataclasses.replace(LEARN, precision=p), text_tokens())
    return out


@pytest.fixture(scope="module")
def two_cpu_ranks() -> dict:
    return run_on_ranks(variants, 2, args=(("auto",), ()), timeout_s=300)[0]


@requires_gpus(1)
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_loss_falls_on_cuda_in_each_precision(precision, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    mg.init(backend="cuda")
    result = train(dataclasses.replace(LEARN, precision=precision), text_tokens())
    assert result["device"] == "cuda:0" and result["scaler"] == (precision == "fp16")
    assert loss_fell(result["losses"]), result["losses"]


@requires_gpus(1)
def test_ddp_on_cuda_every_sync_backend_agrees_and_matches_cpu_ranks(two_cpu_ranks):
    placement, syncs = (NCCL_2, ("auto", "gloo", "cpu")) if _gpus() >= 2 else (SHARED_1, ("auto", "cpu"))
    r0, r1 = run_on_ranks(variants, 2, args=(syncs, ("bf16", "fp16")), backend="cuda", **placement, timeout_s=300)
    for name in r0:
        assert r0[name]["device"].startswith("cuda") and r1[name]["device"].startswith("cuda")
        for key in r0[name]["state"]:  # DDP keeps replicas identical, bit for bit
            assert torch.equal(r0[name]["state"][key], r1[name]["state"][key]), f"{name}: ranks disagree on {key}"
    reference = r0["fp32-auto"]["state"]
    for sync in syncs[1:]:  # the cpu hook stages CUDA buckets through host memory: same average
        assert_close(r0[f"fp32-{sync}"]["state"], reference, f"sync {sync} vs auto", rtol=1e-6, atol=1e-7)
    # the gradients averaged, not summed: compared themselves, and by plain SGD's steps (which Adam would hide)
    assert_same_training(r0["fp32-auto"], two_cpu_ranks["fp32-auto"], "2 CUDA ranks vs 2 CPU ranks")
    for sync in syncs:
        assert_same_sgd(r0[f"sgd-{sync}"], two_cpu_ranks["sgd-auto"], f"sgd, sync {sync}: 2 CUDA ranks vs 2 CPU ranks")
    for precision in ("bf16", "fp16"):
        assert loss_fell(r0[precision]["losses"]), (precision, r0[precision]["losses"])
    assert r0["fp16"]["scaler"] and not r0["bf16"]["scaler"]


@requires_gpus(1)
def test_hybrid_gpu_and_cpu_ranks_match_two_cpu_ranks(two_cpu_ranks):
    r0, r1 = run_on_ranks(variants, 2, args=(("auto", "cpu"), ()), backend="auto", **HYBRID, timeout_s=300)
    assert r0["fp32-auto"]["device"] == "cuda:0" and r1["fp32-auto"]["device"] == "cpu"
    reference = two_cpu_ranks["fp32-auto"]
    for name in ("fp32-auto", "fp32-cpu"):
        # the same averaged gradients on both ranks; the optimizer's float ops differ by ulps between devices
        assert_close(r0[name]["state"], r1[name]["state"], f"{name}: GPU rank vs CPU rank", rtol=1e-5, atol=1e-6)
        assert_same_training(r0[name], reference, f"{name}: hybrid vs 2 CPU ranks")
    for sync in ("auto", "cpu"):
        assert_same_sgd(r0[f"sgd-{sync}"], two_cpu_ranks["sgd-auto"], f"sgd, sync {sync}: hybrid vs 2 CPU ranks")
