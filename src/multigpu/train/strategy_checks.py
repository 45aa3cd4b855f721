"""What each training strategy needs and holds, checked before anything runs (pure: shapes and numbers only).

The launcher checks a job with these before anything is written or spawned (:func:`multigpu.train.job.check`),
on a model built on the ``meta`` device; the dry run and the planner read the same figures; inside the ranks the
strategies (:mod:`multigpu.train.strategies`) use the same rules.

* :func:`block_modules`: the modules sharded one by one (the model's repeated blocks, or the classes named in
  ``fsdp_blocks``);
* :func:`check_sharding` refuses a model without parameters, an unknown block class, and a world size (hsdp: a
  shard size) that would leave a rank holding nothing; :func:`check_hsdp` a shard size that does not divide the
  world size; :func:`check_placement` what FSDP cannot do on the job's devices (a hybrid job of GPU and CPU
  ranks, CPU offload without GPUs or alone); :func:`check_sync_backend` NCCL without GPUs;
* :func:`training_state_bytes` is the planned per-rank memory of parameters, gradients and Adam's two moments
  (FSDP2's ``Shard(0)`` layout: ``ceil(rows / N)`` rows of each parameter per rank); :func:`check_fits` refuses
  a plan larger than what a rank may fill, naming it (under hsdp: one shard of a replica's state).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from multigpu.errors import ConfigError

__all__ = ["HYBRID", "OFFLOAD_ALONE", "block_modules", "check_fits", "check_hsdp", "check_placement", "check_sharding",
           "check_sync_backend", "training_state_bytes"]

_ADAM_MOMENTS = 2  # exp_avg and exp_avg_sq, the size of the parameters each


def block_modules(model: nn.Module, class_names: Iterable[str] = ()) -> list[nn.Module]:
    """The modules sharded one by one: those whose class is named in ``class_names``, else the repeated blocks.

    Raises:
        ConfigError: a named class is not in the model (the message lists the classes that are).
    """
    from multigpu.train.speed import find_blocks

    names = list(class_names)
    if not names:
        return find_blocks(model)
    present = {type(m).__name__ for m in model.modules()}
    unknown = [n for n in names if n not in present]
    if unknown:
        choices = ", ".join(sorted(present - {"ModuleList", "ModuleDict", "Sequential"}))
        raise ConfigError(f"fsdp_blocks: {', '.join(unknown)} is not a module class of this model; valid: {choices}")
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def _rows_by_rank(shape: torch.Size, world_size: int) -> list[int]:
    """Rows of dim 0 each rank holds under FSDP2's ``Shard(0)`` (torch.chunk layout: ceil(rows / N) each)."""
    rows = shape[0] if len(shape) else 1
    per = math.ceil(rows / world_size)
    return [max(0, min(rows, (r + 1) * per) - r * per) for r in range(world_size)]


def check_sharding(model: nn.Module, world_size: int, class_names: Iterable[str] = (), strategy: str = "fsdp") -> None:
    """Raise a one-line ConfigError when ``model`` cannot be sharded usefully over ``world_size`` ranks
    (under hsdp: the ``hsdp_shard_size`` ranks of one replica).

    Pure: reads parameter shapes only (a model on the ``meta`` device will do).
    """
    params = list(model.parameters())
    if not params:
        raise ConfigError(f"strategy={strategy}: the model ({type(model).__name__}) has no parameters to shard; "
                          "valid: a model with parameters, or strategy=ddp")
    block_modules(model, class_names)
    held = [0] * world_size
    for p in params:
        for r, rows in enumerate(_rows_by_rank(p.shape, world_size)):
            held[r] += rows
    empty = [r for r, n in enumerate(held) if n == 0]
    if empty:
        largest = max((p.shape[0] if p.dim() else 1) for p in params)
        if strategy == "hsdp":
            raise ConfigError(f"strategy=hsdp with hsdp_shard_size={world_size} leaves rank {empty[0]} of each replica "
                              f"with no parameters (the largest parameter has {largest} rows); valid: "
                              f"hsdp_shard_size at most {largest}, or strategy=ddp")
        raise ConfigError(f"strategy=fsdp on {world_size} ranks leaves rank {empty[0]} with no parameters "
                          f"(the largest parameter has {largest} rows); valid: at most {largest} ranks, "
                          "or strategy=ddp")


OFFLOAD_ALONE = ("fsdp_cpu_offload=true at world size 1: sharding over one rank needs a process group this job "
                 "does not have, so nothing would be offloaded; valid: 2 or more ranks, or fsdp_cpu_offload=false")
HYBRID = ("strategy={strategy} in a hybrid job (GPU and CPU ranks): one sharded model cannot live on both kinds of "
          "device; valid: strategy=ddp, every rank on a GPU (no --allow-cpu-ranks), or every rank on the CPU (--cpu)")


def check_placement(world_size: int, device_types: Iterable[str], cpu_offload: bool, strategy: str = "fsdp") -> None:
    """Raise a one-line ConfigError where FSDP (or HSDP) cannot run on the job's devices as configured (pure)."""
    kinds = set(device_types)
    if kinds == {"cuda", "cpu"}:
        raise ConfigError(HYBRID.format(strategy=strategy))
    if cpu_offload and world_size == 1:
        raise ConfigError(OFFLOAD_ALONE)
    if cpu_offload and "cuda" not in kinds:
        raise ConfigError("fsdp_cpu_offload=true needs GPU ranks (CPU ranks keep everything in host memory already); "
                          "valid here: fsdp_cpu_offload=false")


def training_state_bytes(model: nn.Module, world_size: int, sharded: bool) -> dict[str, int]:
    """Planned bytes of parameters, gradients and Adam state on one rank (the largest shard when sharded)."""
    total = 0
    for p in {id(p): p for p in model.parameters()}.values():
        share = max(_rows_by_rank(p.shape, world_size)) if sharded else (p.shape[0] if p.dim() else 1)
        row = p.numel() // max(p.shape[0] if p.dim() else 1, 1)
        total += share * row * p.element_size()
    grads = total
    return {"params": total, "grads": grads, "optimizer": _ADAM_MOMENTS * total}


def check_fits(model: nn.Module, world_size: int, strategy: str, budget: int, where: str,
               shard_size: int | None = None) -> None:
    """Raise a one-line ConfigError when the planned training state of one rank exceeds ``budget`` bytes (pure).

    ``where`` says where the budget comes from (it ends the "a rank may fill about ..." clause). ``shard_size``:
    under hsdp, the ranks of one replica (each holds 1/shard_size of the state, not 1/world_size)."""
    shards = shard_size if strategy == "hsdp" and shard_size else world_size
    sharded = strategy != "ddp" and world_size > 1
    plan = training_state_bytes(model, shards, sharded)
    need = sum(plan.values())
    if need <= budget:
        return
    how = f"sharded over {shards} ranks" if sharded else "a whole replica on every rank"
    if strategy == "hsdp":
        replicas = world_size // shards
        how += f" of a replica, {replicas} replica{'s' if replicas > 1 else ''}"
    parts = (f"parameters {_mib(plan['params'])}, gradients {_mib(plan['grads'])}, "
             f"Adam {_mib(plan['optimizer'])}: {how}")
    if strategy == "hsdp" and shards < world_size:
        whole = sum(training_state_bytes(model, world_size, True).values())
        valid = (f"a larger hsdp_shard_size (up to {world_size}: {_mib(whole)} per rank), --strategy fsdp, "
                 "more ranks per node, or a machine with more memory")
    elif sharded:
        valid = "more ranks (fsdp holds 1/N of it each), fewer ranks on this node, or a machine with more memory"
    else:
        fsdp = sum(training_state_bytes(model, world_size, True).values()) if world_size > 1 else need
        valid = (f"--strategy fsdp ({_mib(fsdp)} per rank on {world_size} ranks), " if world_size > 1 else
                 "2 or more ranks with --strategy fsdp, ") + "fewer ranks on this node, or more memory"
    raise ConfigError(f"strategy={strategy}: the planned training state per rank is {_mib(need)} ({parts}) but a "
                      f"rank may fill about {_mib(budget)} ({where}); valid: {valid}")


def _mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def check_hsdp(world_size: int, shard_size: int) -> None:
    """Raise a one-line ConfigError when ``shard_size`` ranks per replica do not tile ``world_size`` (pure)."""
    if shard_size < 1 or world_size % shard_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"strategy=hsdp: hsdp_shard_size={shard_size} does not divide the world size {world_size} "
                          f"into whole replicas; valid: {', '.join(map(str, divisors))}")


def check_sync_backend(sync_backend: str, device_type: str) -> None:
    """Launcher-side check: nccl needs GPU ranks."""
    if sync_backend == "nccl" and device_type != "cuda":
        raise ConfigError("--sync-backend nccl needs GPUs, but this job runs on CPU ranks; "
                          "valid here: auto, gloo, cpu")
