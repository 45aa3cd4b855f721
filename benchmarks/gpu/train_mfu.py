"""Training throughput and MFU of a GPT-2-small-sized model: multigpu's Trainer vs nanoGPT's bench.py loop.

    python benchmarks/gpu/train_mfu.py [--batch-size 12] [--burn-in 10] [--steps 20] [--json OUT.json]
    python benchmarks/gpu/train_mfu.py --quick        # a tiny model on the CPU, no compile: seconds

The model (both sides): ``multigpu.train.model.GPT`` at GPT-2 small's size: 12
layers, 12 heads, width 768, block 1024, vocabulary 50304 (124M parameters),
no bias, no dropout; the architecture is nanoGPT's (pre-LayerNorm blocks,
scaled-dot-product causal attention, 4x GELU MLP, tied embeddings). The loss
is computed inside the compiled graph (``torch.compile`` of model + cross
entropy), under bf16 autocast with fp32 weights and TF32 allowed, on random
tokens (bench.py's ``real_data = False`` has no data loading at all; here both
sides read random windows of one token array, as its ``real_data = True`` does).

* **peer**: a reimplementation of nanoGPT's ``bench.py`` measured loop (no
  nanoGPT code is copied or imported; it is not on the GPU machine): AdamW
  with its decay groups, ``fused=True`` on CUDA, lr 1e-4, betas (0.9, 0.95),
  weight decay 1e-2; per iteration: forward under autocast, fetch the next
  batch (pinned, non-blocking copy), zero_grad, backward, step, ``loss.item()``;
  10 burn-in iterations, then 20 timed between two ``cuda.synchronize()``.
* **ours**: ``multigpu.train.Trainer`` at world size 1, the body of
  ``Trainer.fit`` per step (``train_step``: its data stream with prefetch,
  autocast, grad-norm, optimizer and schedule step, step meter; plus the metric
  logger), with the project's own optimizer (``make_optimizer``), timed the same way.

MFU is nanoGPT's estimate: FLOPs per token ``6N + 12 L H Q T`` (N = parameters
without position embeddings) times tokens/s, over the GPU's dense bf16 peak
(``multigpu.train.mfu.PEAK_TFLOPS`` by exact board name: H100 SXM 989e12, PCIe 756e12, NVL 835e12). bench.py
prints it in A100 units (312e12): ``mfu_a100_units`` is that figure. The
NVML sampler (``multigpu.monitor.Sampler``) runs during each side's timed
steps. Each side runs in its own subprocess, one after the other (in this process under ``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common
import numpy as np
import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class Size:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    block_size: int = 1024
    vocab: int = 50304
    batch_size: int = 12
    burn_in: int = 10
    steps: int = 20
    compile: bool = True


QUICK = Size(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab=512, batch_size=4, burn_in=2, steps=3, compile=False)


def forward_loss(model, x, y):
    """Logits and cross entropy in one graph, as nanoGPT's ``forward(idx, targets)`` computes them."""
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def _tokens(size: Size) -> np.ndarray:
    n = (size.burn_in + size.steps + 4) * size.batch_size * (size.block_size + 1) * 2
    return np.random.default_rng(1337).integers(0, size.vocab, n).astype(np.uint16)


def _model(size: Size):
    from multigpu.train.model import GPT
    from multigpu.train.nano import ModelConfig

    torch.manual_seed(1337)
    cfg = ModelConfig(n_layer=size.n_layer, n_head=size.n_head, n_embd=size.n_embd, block_size=size.block_size,
                      dropout=0.0, bias=False)
    return GPT(cfg, size.vocab)


@contextlib.contextmanager
def _sampled(device: torch.device, folder: Path):
    """The NVML sampler around the timed steps (GPU only)."""
    if device.type != "cuda":
        yield
        return
    from multigpu.monitor import Sampler

    with Sampler(folder, interval_s=0.25, node_rank=0):
        yield


def _figures(size: Size, model, device: torch.device, seconds: float, first_s: float, loss: float, folder: Path) -> dict:
    tokens = size.batch_size * size.block_size * size.steps
    flops = model.flops_per_token() * tokens / seconds
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = _common.peak_bf16_flops(name)
    return {"tokens_per_s": tokens / seconds, "ms_per_iter": 1000 * seconds / size.steps, "model_flops_per_s": flops,
            "mfu": flops / peak if peak else None, "mfu_a100_units": flops / 312e12, "peak_flops": peak,
            "first_step_s": first_s, "final_loss": loss, "params": model.num_params(),
            "peak_memory_gib": _common.peak_memory_gib(device),
            "sampler": _common.sampler_summary(folder / "samples_node0.jsonl")}


def peer(size: Size, device: torch.device, folder: Path) -> dict:
    """nanoGPT bench.py's measured loop, reimplemented (see the module docstring)."""
    torch.manual_seed(1337)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cuda = device.type == "cuda"
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()  # bench.py: none on CPU
    data = _tokens(size)
    block = size.block_size

    def get_batch():
        ix = torch.randint(len(data) - block, (size.batch_size,))
        x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        if cuda:
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    model = _model(size).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 1e-2},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), **({"fused": True} if cuda else {}))
    fwd = torch.compile(forward_loss) if size.compile else forward_loss

    def iterations(num: int) -> float:
        x, y = get_batch()
        lossf = float("nan")
        for _ in range(num):
            with ctx:
                loss = fwd(model, x, y)
            x, y = get_batch()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            lossf = loss.item()
        return lossf

    _, first_s = _common.timed(lambda: iterations(1), device)  # compilation happens here
    iterations(size.burn_in - 1)
    with _sampled(device, folder):
        loss, seconds = _common.timed(lambda: iterations(size.steps), device)
    return _figures(size, model, device, seconds, first_s, loss, folder)


def ours(size: Size, device: torch.device, folder: Path) -> dict:
    """multigpu's Trainer at world size 1 on the same model, data and batch."""
    import multigpu as mg
    from multigpu.train import TrainConfig, Trainer, make_optimizer, make_scheduler
    from multigpu.train.data import CharDataset

    env = mg.init(backend=device.type)
    model = _model(size)
    cfg = TrainConfig(steps=size.burn_in + size.steps, batch_size=size.batch_size, lr=1e-4, min_lr=1e-5,
                      warmup_steps=0, weight_decay=1e-2, beta1=0.9, beta2=0.95, grad_clip=0.0,
                      precision="bf16" if env.device.type == "cuda" else "fp32", tf32=True, eval_every=0,
                      log_every=0, checkpoint_every=0, prefetch=2, seed=1337)
    optimizer = make_optimizer(model, cfg)
    fwd = torch.compile(forward_loss) if size.compile else forward_loss
    data = CharDataset(torch.from_numpy(_tokens(size).astype(np.int32)), size.block_size)
    trainer = Trainer(model, optimizer, data, config=cfg, scheduler=make_scheduler(optimizer, cfg),
                      loss_fn=lambda m, batch: fwd(m, *batch), run_dir=None)
    trainer.setup()

    def steps(num: int) -> float:
        loss = torch.zeros(())
        for _ in range(num):  # Trainer.fit's body, without its validation and checkpoint points
            metrics = trainer.train_step()
            trainer.run.end_step()  # what the run does after a step (here: counts it; no log point, no checkpoint)
            loss = metrics["loss"]
        return float(loss)

    _, first_s = _common.timed(lambda: steps(1), env.device)
    steps(size.burn_in - 1)
    with _sampled(env.device, folder):
        loss, seconds = _common.timed(lambda: steps(size.steps), env.device)
    out = _figures(size, model, env.device, seconds, first_s, loss, folder)
    trainer.close()
    mg.shutdown()
    return out


def _child(side: str, size: Size, device: str) -> None:
    import json

    dev = _common.pick_device(device)
    with tempfile.TemporaryDirectory(prefix=f"train_mfu_{side}_") as tmp:
        result = (ours if side == "ours" else peer)(size, dev, Path(tmp))
    print("RESULT " + json.dumps(result), flush=True)


def _run_side(side: str, size: Size, device: str, timeout_s: float, inline: bool) -> dict:
    if inline:  # --quick: no child process (the smoke test's time is mostly torch imports)
        with tempfile.TemporaryDirectory(prefix=f"train_mfu_{side}_") as tmp:
            return (ours if side == "ours" else peer)(size, _common.pick_device(device), Path(tmp))
    argv = [sys.executable, __file__, "--child", side, "--device", device, "--size", repr(dataclasses.asdict(size))]
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:g}s"}
    result = _common.child_result(proc.stdout)
    if result is None:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-3:]
        return {"error": f"exit code {proc.returncode}: " + " | ".join(tail)}
    result["wall_s"] = time.perf_counter() - start
    return result


def main() -> int:
    p = _common.parser(__doc__)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--burn-in", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--side-timeout-s", type=float, default=300.0, help="limit for each side's subprocess")
    p.add_argument("--child", choices=["ours", "peer"], help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    _common.add_estimate_flag(p)
    args = p.parse_args()
    if args.child:
        import ast

        _child(args.child, Size(**ast.literal_eval(args.size)), args.device)
        return 0
    size = QUICK if args.quick else Size()
    overrides = {k: v for k, v in (("batch_size", args.batch_size), ("burn_in", args.burn_in), ("steps", args.steps))
                 if v is not None}
    if args.no_compile:
        overrides["compile"] = False
    size = dataclasses.replace(size, **overrides)
    if size.burn_in < 1 or size.steps < 1 or size.batch_size < 1:
        print("error: --batch-size, --burn-in and --steps must be >= 1", file=sys.stderr)
        return 2
    if args.estimate:
        return _common.print_estimate(estimate(size))
    device = "cpu" if args.quick and args.device == "auto" else args.device
    dev = _common.pick_device(device)
    print(f"GPT {size.n_layer}x{size.n_embd}, block {size.block_size}, vocab {size.vocab}, batch {size.batch_size}, "
          f"compile {size.compile}, on {dev}: {size.burn_in} burn-in + {size.steps} timed iterations per side", flush=True)
    machine = _common.machine()
    results: dict[str, dict] = {}
    for side in ("peer", "ours"):  # the record is rewritten as each side ends: a run cut short keeps the first
        results[side] = _run_side(side, size, device, args.side_timeout_s, args.quick)
        _common.write_record(args.json, _record(machine, size, results), quiet=True)
    for side, r in results.items():
        if "error" in r:
            print(f"  {side:<5} failed: {r['error']}")
        else:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (no peak for this device)"
            print(f"  {side:<5} {r['tokens_per_s']:>12,.0f} tokens/s  {r['ms_per_iter']:8.1f} ms/iter  MFU {mfu}  "
                  f"(bench.py's A100 units: {r['mfu_a100_units']:.1%})  loss {r['final_loss']:.3f}", flush=True)
    ok = all("error" not in r for r in results.values())
    ratio = results["ours"]["tokens_per_s"] / results["peer"]["tokens_per_s"] if ok else None
    if ratio is not None:
        print(f"  ours / nanoGPT bench.py loop: {ratio:.3f}x")
    _common.write_record(args.json, _record(machine, size, results))
    return 0 if ok else 1


def _record(machine: dict, size: Size, results: dict[str, dict]) -> dict:
    """The record of the sides run so far (a side not run yet: ``{"pending": true}``)."""
    ours, peer = results.get("ours", {"pending": True}), results.get("peer", {"pending": True})
    done = all("tokens_per_s" in r for r in (ours, peer))
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"] if done else None
    mfu = ours.get("mfu")
    return {"benchmark": "train_mfu", "machine": machine, "config": dataclasses.asdict(size),
            "ours": ours, "peer": {"name": "nanoGPT bench.py loop (reimplemented)", **peer},
            "ratio": ratio, "targets": {"mfu >= 0.45": mfu >= 0.45 if mfu is not None else None,
                                        "ratio >= 1.0": ratio >= 1.0 if ratio is not None else None}}


def estimate(size: Size) -> dict[str, float]:
    """Seconds on one H100: two processes (peer, then ours), each starting, compiling (the second finds the first's
    graph in inductor's on-disk cache) and running its iterations at ``ASSUMED_MFU`` (nanoGPT's FLOPs per token)."""
    params = 12 * size.n_layer * size.n_embd ** 2 + size.vocab * size.n_embd
    flops_per_token = 6 * params + 12 * size.n_layer * size.n_embd * size.block_size
    iteration_s = size.batch_size * size.block_size * flops_per_token / (_common.H100_BF16_FLOPS * _common.ASSUMED_MFU)
    compiles = (_common.COMPILE_COLD_S, _common.COMPILE_WARM_S) if size.compile else (0.0, 0.0)
    return {"peer: start": _common.STARTUP_S, "peer: compile (cold)": compiles[0],
            "peer: iterations": (size.burn_in + size.steps) * iteration_s,
            "ours: start": _common.STARTUP_S, "ours: compile (warm cache)": compiles[1],
            "ours: iterations": (size.burn_in + size.steps) * iteration_s, "samplers and data": 4.0}


if __name__ == "__main__":
    raise SystemExit(main())
