"""The GPU smoke step: does each workload run at all on this GPU? About a minute; each check recorded as it ends.

    python benchmarks/gpu/smoke_gpu.py --json OUT.json     # on the GPU machine (run_all.sh's first step)
    python benchmarks/gpu/smoke_gpu.py --quick             # the same checks on the CPU (gloo): seconds

In one process, with a real process group of one (``cpu:gloo,cuda:nccl`` bound to the GPU, as ``mg.init``
makes it; gloo alone on the CPU):

* ``nccl_all_reduce``: one all-reduce of a CUDA tensor over NCCL, its value checked;
* ``ddp_step``: one training step of the nano GPT wrapped in DDP (the built-in NCCL hook), backward included;
* ``fsdp_step``: one step of the same model under ``fully_shard`` on a mesh of this GPU;
* ``infer_cuda_input``: ``sliding_window_inference`` of an image already on the GPU (MONAI's call shape);
* ``sim_step``: one SIR step on the GPU;
* ``env_step``: CartPole reset and one step of 4096 environments on the GPU.

The record (``--json``) is rewritten after every check, so a check that hangs past the step's cap leaves the
ones before it; each check says ok, its seconds, and its error's last line when it failed.
"""

from __future__ import annotations

import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import _common
import torch
import torch.distributed as dist

ESTIMATE = {"python, torch and CUDA start": _common.STARTUP_S, "NCCL communicator": 5.0, "DDP step (nano GPT, eager)": 4.0,
            "FSDP step": 4.0, "inference": 3.0, "sim step": 3.0, "env step": 2.0}
"""Seconds each part takes on one H100 (eager kernels, no compile), the step's estimate for its cap."""


def _nano(device: torch.device):
    from multigpu.train.nano import gpt

    torch.manual_seed(0)
    return gpt(block_size=32, vocab_size=64, n_layer=2, n_head=2, n_embd=64).to(device)


def _train_step(model, device: torch.device) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    x = torch.randint(0, 64, (4, 32), device=device)
    logits = model(x)
    logits = logits[0] if isinstance(logits, tuple) else logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x.reshape(-1))
    loss.backward()
    optimizer.step()
    value = loss.detach().item()
    if not value == value:
        raise RuntimeError(f"the loss is {value}")
    return value


def nccl_all_reduce(device):
    x = torch.full((1024,), 2.0, device=device)
    dist.all_reduce(x)
    if float(x.sum()) != 2048.0:
        raise RuntimeError(f"all_reduce over a group of one changed the values: sum {float(x.sum())}")
    return {"backend": dist.get_backend(), "bytes": x.numel() * x.element_size()}


def ddp_step(device):
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(_nano(device), device_ids=[device.index] if device.type == "cuda" else None)
    return {"loss": _train_step(ddp, device)}


def fsdp_step(device):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _nano(torch.device("cpu"))
    mesh = init_device_mesh(device.type, (1,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return {"loss": _train_step(model, device)}


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


CHECKS: list[tuple[str, Callable]] = [("nccl_all_reduce", nccl_all_reduce), ("ddp_step", ddp_step),
                                       ("fsdp_step", fsdp_step), ("infer_cuda_input", infer_cuda_input),
                                       ("sim_step", sim_step), ("env_step", env_step)]


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
    with tempfile.TemporaryDirectory(prefix="smoke_gpu_") as tmp:
        # a real group of one, as mg.init makes it on a GPU rank: NCCL bound to the device, gloo beside it
        kwargs = {"backend": "cpu:gloo,cuda:nccl", "device_id": device} if device.type == "cuda" else {"backend": "gloo"}
        dist.init_process_group(init_method=f"file://{Path(tmp) / 'store'}", rank=0, world_size=1, **kwargs)
        mg.init(backend=device.type)  # joins the group above: the workloads' own device and collectives
        try:
            for name, check in CHECKS:
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
                print(f"  {name:<18} {'ok' if entry['ok'] else 'FAILED: ' + entry['error']} "
                      f"({entry['seconds']:.1f} s)", flush=True)
                _common.write_record(args.json, record, quiet=True)
        finally:
            mg.shutdown(barrier=False)
            if dist.is_initialized():
                dist.destroy_process_group()
    _common.write_record(args.json, record)
    return 0 if all(c["ok"] for c in record["checks"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
