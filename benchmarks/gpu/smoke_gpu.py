"""The GPU smoke step: what one GPU can show of every path, each check recorded as it ends (about half a minute).

    python benchmarks/gpu/smoke_gpu.py --json OUT.json     # on the GPU machine (run_all.sh's first step)
    python benchmarks/gpu/smoke_gpu.py --quick             # the same checks on the CPU (gloo): seconds

First with a real process group of one (``cpu:gloo,cuda:nccl`` bound to the GPU, as ``mg.init`` makes it; gloo
alone on the CPU):

* ``nccl_all_reduce``: one all-reduce of a CUDA tensor over NCCL, its value checked;
* ``ddp_wrappers``: the Trainer's DDP wrapper (``multigpu.train.strategies.wrap_ddp``) with each sync backend one GPU
  allows (``auto``: DDP's own NCCL all-reduce; ``gloo`` and ``cpu``: our timed hooks over a gloo group beside NCCL,
  ``cpu`` staging each bucket through host memory), a step of the nano GPT each: the gradients must be the
  unwrapped model's (an average over one rank is the gradient itself);
* ``fsdp_wrapper``, ``hsdp_wrapper``: the Trainer's sharding (``multigpu.train.strategies.shard_model``: blocks then
  the root, bf16 parameters, fp32 reductions) over a mesh of this GPU, 1-D and HSDP's 2-D ``(replicate, shard)``
  (1 x 1): every parameter and gradient a DTensor of that mesh, the loss within bf16's reach of the unwrapped
  model's under autocast;
* ``checkpoint_ddp``, ``checkpoint_fsdp``: the Trainer on this GPU writes checkpoints in the background (async:
  pinned staging; ``strategy=fsdp`` through DCP, ``ddp`` into state.pt), a second Trainer resumes from the step-2
  checkpoint: its model, optimizer and step equal the saved ones bit for bit, and its next steps land where the
  uninterrupted run did (exact, or within what Adam makes of float rounding: see ``_close``);
* ``infer_cuda_input``, ``sim_step``, ``env_step``: ``sliding_window_inference`` of an image already on the GPU,
  one SIR step, CartPole reset and one step of 4096 environments on the GPU.

Then, the group of one gone, ``fakepg_2``, ``fakepg_4``, ``fakepg_8``: this process as rank 0 of 2, 4 and 8 on
torch's ``fake`` process group (collectives return at once and move no data) with real CUDA tensors: the Trainer
itself (``strategy`` ddp, fsdp, hsdp with ``hsdp_shard_size = N/2``) sets up and takes two steps, so DDP's
reducer (its all-reduce a pass-through hook: the fake group's future holds no tensor), ``fully_shard`` on a mesh
of N and HSDP's 2-D mesh run their real kernels, forward and backward, on shards of the size N ranks would hold. Recorded per strategy: this rank's parameter elements against the whole
model's, the GPU memory after setup and after a step, the peak. What it cannot show: the values (a fake collective
moves nothing), NCCL between GPUs, and the time collectives take.

The record (``--json``) is rewritten after every check, so a check that hangs past the step's cap leaves the
ones before it; each check says ok, its seconds, and its error's last line when it failed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import _common
import torch
import torch.distributed as dist

ESTIMATE = {"python, torch and CUDA start": _common.STARTUP_S, "NCCL communicator": 3.0, "DDP wrappers (3)": 6.0,
            "FSDP and HSDP wrappers": 3.0, "checkpoints from CUDA, resumed (2)": 8.0, "inference": 2.0,
            "sim step": 2.0, "env step": 1.0, "fake process group at 2, 4, 8 (3 strategies each)": 9.0}
"""Seconds each part takes on one H100 (eager kernels, no compile), the step's estimate for its cap (the first
GPU call: start and six checks in 11 s, the first DDP step 4.3 s)."""
FAKE_SIZES = (2, 4, 8)


def _nano(device: torch.device):
    from multigpu.train.nano import gpt

    torch.manual_seed(0)
    return gpt(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=64).to(device)


def _batch(device: torch.device) -> torch.Tensor:
    return torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(3)).to(device)


def _loss(model, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    logits = logits[0] if isinstance(logits, tuple) else logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x.reshape(-1))


def _finite(value: float) -> float:
    if not value == value or value in (float("inf"), float("-inf")):
        raise RuntimeError(f"the loss is {value}")
    return value


def nccl_all_reduce(device):
    x = torch.full((1024,), 2.0, device=device)
    dist.all_reduce(x)
    if float(x.sum()) != 2048.0:
        raise RuntimeError(f"all_reduce over a group of one changed the values: sum {float(x.sum())}")
    return {"backend": dist.get_backend(), "bytes": x.numel() * x.element_size()}


def ddp_wrappers(device):
    """wrap_ddp with each sync backend one GPU allows: the gradients equal the unwrapped model's."""
    import multigpu as mg
    from multigpu.train.strategies import wrap_ddp

    x = _batch(device)
    plain = _nano(device)
    _loss(plain, x).backward()
    reference = {n: p.grad for n, p in plain.named_parameters()}
    out = {}
    for sync in ("auto", "gloo", "cpu"):
        module = _nano(device)
        ddp, timer = wrap_ddp(module, mg.get_env("smoke"), sync)
        loss = _loss(ddp, x)
        loss.backward()
        out[f"{sync}_loss"] = _finite(float(loss.detach()))
        worst = max((p.grad - reference[n]).abs().max().item() for n, p in module.named_parameters())
        out[f"{sync}_grad_max_diff"] = worst
        out[f"{sync}_timed_by"] = type(timer).__name__
        if worst > 1e-6:
            raise RuntimeError(f"sync_backend={sync}: the gradients differ from the unwrapped model's by {worst:.2e} "
                               "(an average over one rank is the gradient itself)")
        del ddp
    return out


def _sharded_wrapper(device, shard_size: int | None):
    """shard_model over a mesh of this device (1-D, or HSDP's 2-D with ``shard_size``): one step."""
    from torch.distributed.tensor import DTensor

    from multigpu.train.strategies import shard_model

    cuda = device.type == "cuda"
    x = _batch(device)
    module = _nano(torch.device("cpu"))
    reference = copy.deepcopy(module).to(device)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    shard_model(module, optimizer, device=device, param_dtype=torch.bfloat16 if cuda else None,
                shard_size=shard_size)
    params = dict(module.named_parameters())
    if not all(isinstance(p, DTensor) and p.device.type == device.type for p in params.values()):
        raise RuntimeError("shard_model left a parameter that is not a DTensor on this device")
    mesh = next(iter(params.values())).device_mesh
    if mesh.ndim != (2 if shard_size else 1):
        raise RuntimeError(f"the mesh has {mesh.ndim} dimension(s), wanted {2 if shard_size else 1}")
    loss = _loss(module, x)
    loss.backward()
    optimizer.step()
    if not all(isinstance(p.grad, DTensor) for p in params.values()):
        raise RuntimeError("a gradient is not a DTensor of the mesh")
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        expected = float(_loss(reference, x))
    value = _finite(float(loss.detach()))
    if abs(value - expected) > 0.05 * abs(expected):
        raise RuntimeError(f"loss {value:.4f} under the sharded wrapper, {expected:.4f} unwrapped")
    return {"loss": value, "reference_loss": expected, "mesh": list(mesh.shape),
            "placements": str(next(iter(params.values())).placements)}


def fsdp_wrapper(device):
    return _sharded_wrapper(device, None)


def hsdp_wrapper(device):
    return _sharded_wrapper(device, 1)


def _tokens(block: int) -> torch.Tensor:
    from multigpu.train.data import VOCAB

    return torch.randint(0, len(VOCAB), (block * 64 + 1,), generator=torch.Generator().manual_seed(7),
                         dtype=torch.uint8)


def _trainer(size: str = "tiny", **overrides):
    """The project's Trainer on the tiny GPT (``big``: 4 layers, 256 wide, 3.2M parameters) with random tokens."""
    from multigpu.train import ModelConfig, TrainConfig, Trainer, make_optimizer, make_scheduler
    from multigpu.train.data import VOCAB, CharDataset
    from multigpu.train.model import GPT

    model_cfg = (ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=32) if size == "tiny" else
                 ModelConfig(n_layer=4, n_head=4, n_embd=256, block_size=64))
    options = {k: overrides.pop(k) for k in ("run_dir", "resume", "callbacks") if k in overrides}
    cfg = TrainConfig(**{"steps": 4, "global_batch_size": 16, "lr": 3e-3, "warmup_steps": 1, "eval_every": 0,
                         "log_every": 0, "checkpoint_every": 0, "prefetch": 0, "tf32": False, **overrides})
    torch.manual_seed(0)
    model = GPT(model_cfg, len(VOCAB))
    optimizer = make_optimizer(model, cfg)
    return Trainer(model, optimizer, CharDataset(_tokens(model_cfg.block_size), model_cfg.block_size), config=cfg,
                   scheduler=make_scheduler(optimizer, cfg), **options)


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    """The trainer's model and optimizer tensors, and its step, on the host."""
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in trainer.module.state_dict().items()}
    for i, state in enumerate(trainer.optimizer.state.values()):
        for name, value in state.items():
            out[f"optimizer.{i}.{name}"] = torch.as_tensor(value).detach().cpu().clone()
    out["step"] = torch.tensor(trainer.step)
    return out


def _close(a: dict, b: dict, lr: float, steps: int) -> dict:
    """Two trainings that should be the same: exact, or within what Adam makes of float rounding (99.9% of the
    elements within rtol 1e-4, atol 1e-5, every one within 1% of lr x steps), else an error."""
    worst, share = 0.0, 1.0
    for key, x in a.items():
        d = (x.double() - b[key].double()).abs()
        worst = max(worst, d.max().item() if d.numel() else 0.0)
        if d.numel():
            share = min(share, (d <= 1e-5 + 1e-4 * b[key].double().abs()).double().mean().item())
    if share < 0.999 or worst > 0.01 * lr * steps:
        raise RuntimeError(f"the resumed run ends {worst:.2e} from the uninterrupted one ({share:.2%} of the "
                           "elements within rtol 1e-4, atol 1e-5)")
    return {"exact": worst == 0.0, "max_diff": worst}


def _checkpoint_resume(device, strategy: str):
    with tempfile.TemporaryDirectory(prefix=f"smoke_ckpt_{strategy}_") as tmp:
        saved: dict = {}

        class KeepStep2:
            trainer = None

            def on_step(self, event) -> None:
                if event.step == 2:
                    saved.update(_snapshot(self.trainer))

        keep = KeepStep2()
        options = {"strategy": strategy, "checkpoint_every": 2, "checkpoint_mode": "async"}
        first = keep.trainer = _trainer(run_dir=f"{tmp}/a", callbacks=[keep], **options)
        first.fit()
        uninterrupted = _snapshot(first)
        first.close()
        checkpoint = Path(tmp) / "a" / "checkpoints" / "step_00000002"
        files = sorted(p.name for p in checkpoint.iterdir())
        resumed = _trainer(run_dir=f"{tmp}/b", resume=str(checkpoint), **options)
        resumed.setup()
        loaded = _snapshot(resumed)
        differ = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        if differ or loaded.keys() != saved.keys():
            raise RuntimeError(f"resumed from step 2 but {len(differ)} tensor(s) differ from what was saved, "
                               f"e.g. {differ[:3]}; keys {sorted(set(saved) ^ set(loaded))[:3]} on one side only")
        resumed.fit()
        after = _close(_snapshot(resumed), uninterrupted, resumed.config.lr, 2)
        resumed.close()
    return {"files": files, "tensors_resumed": len(saved), **after}


def checkpoint_ddp(device):
    return _checkpoint_resume(device, "ddp")


def checkpoint_fsdp(device):
    return _checkpoint_resume(device, "fsdp")


def infer_cuda_input(device):
    from multigpu.infer import sliding_window_inference

    net = torch.nn.Conv2d(1, 2, 3, padding=1).to(device)
    image = torch.rand(1, 1, 96, 80).to(device)
    with torch.no_grad():
        out = sliding_window_inference(image, 32, 4, net, overlap=0.25)
    if out.device != image.device or out.shape != (1, 2, 96, 80):
        raise RuntimeError(f"output {tuple(out.shape)} on {out.device}, wanted (1, 2, 96, 80) on {image.device}")
    return {"windows_shape": list(out.shape)}


def sim_step(device):
    from multigpu.sim import SimConfig, SimEngine

    engine = SimEngine(SimConfig(model="sir", agents=100_000, grid=(64, 64), steps=1, plot=False, log_every=0,
                                 params={"beta": 0.05, "gamma": 0.05}))
    engine.step()
    return {"agents": 100_000, "device": str(engine.device)}


def env_step(device):
    import multigpu as mg

    envs = mg.envs.make("CartPole-v1", num_envs=4096, device=device, seed=0)
    envs.reset(seed=0)
    obs, reward, *_ = envs.step(torch.ones(4096, dtype=torch.int64, device=device))
    return {"obs_device": str(obs.device), "reward_sum": float(reward.sum())}


CHECKS: list[tuple[str, Callable]] = [("nccl_all_reduce", nccl_all_reduce), ("ddp_wrappers", ddp_wrappers),
                                       ("fsdp_wrapper", fsdp_wrapper), ("hsdp_wrapper", hsdp_wrapper),
                                       ("checkpoint_ddp", checkpoint_ddp), ("checkpoint_fsdp", checkpoint_fsdp),
                                       ("infer_cuda_input", infer_cuda_input), ("sim_step", sim_step),
                                       ("env_step", env_step)]
"""Checks on the real process group of one, in order."""


def _passthrough(state, bucket):
    """A DDP comm hook that hands the bucket back as it is: what a fake all-reduce would leave. DDP's reducer needs
    the all-reduce's future to hold the tensor, and the fake group's holds nothing."""
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@contextlib.contextmanager
def _ddp_on_the_fake_group():
    """Every DDP made inside: its all-reduce replaced by :func:`_passthrough` (any hook the code registers, the
    Trainer's timed hooks on gloo, is left out: it would wait on the fake group's empty future)."""
    from unittest import mock

    from torch.nn.parallel import DistributedDataParallel as DDP

    real_init = DDP.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        DDP.register_comm_hook(self, None, _passthrough)
        self.register_comm_hook = lambda *a, **k: None

    with mock.patch.object(DDP, "__init__", init):
        yield


@contextlib.contextmanager
def _as_rank_0_of(world_size: int):
    """This process as rank 0 of ``world_size`` (one GPU per node), started by torchrun (its variables), every
    group made by torch's ``fake`` backend (``multigpu.testing.fakecuda.fake_init``: no data moves)."""
    from multigpu.testing.fakecuda import fake_init

    names = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": "1",
             "MASTER_ADDR": "localhost", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "smoke-fakepg"}
    from unittest import mock

    before = {k: os.environ.get(k) for k in names}
    os.environ.update(names)
    try:
        with fake_init(0, world_size), _ddp_on_the_fake_group():
            answered = dist.init_process_group

            def unbound(*args, **kwargs):  # no device_id: a bound group makes DeviceMesh split NCCL's communicator
                kwargs.pop("device_id", None)  # (ncclCommSplit), which the fake group has none of
                return answered(*args, **kwargs)

            with mock.patch.object(dist, "init_process_group", unbound):
                yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _local_elements(module: torch.nn.Module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters())


def _count_gradients(into: list[int], optimizer, *_) -> None:
    """An optimizer step pre-hook: the gradient elements this step applies (this rank's shards)."""
    into.append(sum((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).numel()
                    for g in optimizer.param_groups for p in g["params"] if p.grad is not None))


def fake_world(device: torch.device, world_size: int, size: str) -> dict:
    """The Trainer as rank 0 of ``world_size`` on the fake group, each strategy: its shard, memory, two steps."""
    import multigpu as mg

    out = {}
    cuda = device.type == "cuda"
    with _as_rank_0_of(world_size):
        mg.init(backend=device.type)
        try:
            for strategy, extra in (("ddp", {}), ("fsdp", {}), ("hsdp", {"hsdp_shard_size": world_size // 2})):
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                trainer = _trainer(size, strategy=strategy, run_dir=None, **extra)
                whole = sum(p.numel() for p in trainer.module.parameters())
                trainer.setup()
                local = _local_elements(trainer.module)
                after_setup = torch.cuda.memory_allocated(device) if cuda else None
                stepped: list[int] = []  # each step: the gradient elements the optimizer applies (this rank's)
                trainer.optimizer.register_step_pre_hook(functools.partial(_count_gradients, stepped))
                losses = [float(trainer.train_step()["loss"]) for _ in range(2)]
                if stepped != [local, local]:  # backward gave every parameter this rank holds its gradient
                    raise RuntimeError(f"strategy={strategy}: the optimizer applied {stepped} gradient elements, "
                                       f"wanted {local:,} each step (this rank's parameters)")
                shards = {"ddp": 1, "fsdp": world_size, "hsdp": world_size // 2}[strategy]
                if local > whole // shards + 64 * len(list(trainer.module.parameters())) or local * shards < whole:
                    raise RuntimeError(f"strategy={strategy}: rank 0 holds {local:,} of {whole:,} parameter elements, "
                                       f"not about 1/{shards}")
                out[strategy] = {"elements": local, "share": local / whole, "losses": losses,
                                 "memory_after_setup_mib": after_setup / 2**20 if cuda else None,
                                 "memory_after_step_mib": torch.cuda.memory_allocated(device) / 2**20 if cuda else None,
                                 "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None}
                trainer.close()
                del trainer
        finally:
            mg.shutdown(barrier=False)
    return {"world_size": world_size, "whole_elements": whole, **{f"{s}_{k}": v for s, r in out.items()
                                                                  for k, v in r.items() if k != "losses"}}


def _run(record: dict, name: str, check: Callable, device: torch.device, path: str | None) -> None:
    start = time.perf_counter()
    try:
        out = check(device)
        _common.sync(device)
        entry = {"name": name, "ok": True, **out}
    except Exception as exc:  # noqa: BLE001 - every check runs; its error is the record's
        entry = {"name": name, "ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0][:500],
                 "where": traceback.format_exc().strip().splitlines()[-3:]}
    entry["seconds"] = time.perf_counter() - start
    record["checks"].append(entry)
    record["targets"][f"{name} runs"] = entry["ok"]
    print(f"  {name:<18} {'ok' if entry['ok'] else 'FAILED: ' + entry['error']} ({entry['seconds']:.1f} s)",
          flush=True)
    _common.write_record(path, record, quiet=True)


def main() -> int:
    p = _common.parser(__doc__)
    _common.add_estimate_flag(p)
    args = p.parse_args()
    if args.estimate:
        return _common.print_estimate(dict(ESTIMATE))
    device = _common.pick_device("cpu" if args.quick and args.device == "auto" else args.device)
    import multigpu as mg

    record = {"benchmark": "smoke_gpu", "machine": _common.machine(), "config": {"device": str(device)},
              "checks": [], "targets": {}}
    record["ours"] = record["checks"]  # the rendered table
    with tempfile.TemporaryDirectory(prefix="smoke_gpu_") as tmp:
        # a real group of one, as mg.init makes it on a GPU rank: NCCL bound to the device, gloo beside it
        kwargs = {"backend": "cpu:gloo,cuda:nccl", "device_id": device} if device.type == "cuda" else {"backend": "gloo"}
        dist.init_process_group(init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1, **kwargs)
        mg.init(backend=device.type)  # joins the group above: the workloads' own device and collectives
        try:
            for name, check in CHECKS:
                _run(record, name, check, device, args.json)
        finally:
            mg.shutdown(barrier=False)
            if dist.is_initialized():
                dist.destroy_process_group()
    size = "tiny" if args.quick else "big"
    for n in FAKE_SIZES:  # the group of one is gone: each world is the fake backend's
        _run(record, f"fakepg_{n}", lambda d, n=n: fake_world(d, n, size), device, args.json)
    ok = sum(c["ok"] for c in record["checks"])
    record["summary"] = f"{ok} of {len(record['checks'])} checks ran"
    _common.write_record(args.json, record)
    return 0 if ok == len(record["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
