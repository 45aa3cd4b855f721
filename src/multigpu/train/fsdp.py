"""FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and optimizer state sharded (inside each rank).

``strategy: fsdp`` in :class:`~multigpu.train.config.TrainConfig`. Each rank keeps
``1/world_size`` of every parameter (a ``Shard(0)`` DTensor), of its gradient and of
the optimizer state built on it; a block's full parameters exist only while the
block runs (all-gathered before its forward and backward, freed after).

* :func:`shard_model` applies ``fully_shard`` per block (the model's repeated
  blocks, :func:`multigpu.train.speed.find_blocks`, or the classes named in
  ``fsdp_blocks``), then to the root, over a mesh of this rank's device type
  (``init_device_mesh``: FSDP's default mesh is CUDA's whenever a GPU is
  visible, which would put a CPU rank's parameters on ``cuda:0``), and points
  the optimizer at the new (sharded) parameters. It is given the model on the
  host: ``fully_shard`` moves one block at a time to the device and keeps this
  rank's shard of it, so the whole unsharded model never has to fit on a GPU. Given a model built on
  the ``meta`` device (as ``multigpu train`` builds it), it materializes only this rank's shards
  (:mod:`multigpu.train.meta`): no rank ever holds the whole model, in host memory or on a GPU.
  ``shard_size`` makes the mesh 2-D, ``(replicate, shard)``: HSDP (``strategy: hsdp``): each rank keeps
  ``1/shard_size`` (the same shard as its peers in the other replicas); gradients are reduce-scattered
  within a replica, then all-reduced across replicas (:func:`device_mesh`).
* :func:`check_sharding` (pure; the launcher runs it on a model built on the
  ``meta`` device) refuses a model without parameters, an unknown block class,
  and a world size (hsdp: a shard size) that would leave a rank holding nothing; :func:`check_hsdp` a shard
  size that does not divide the world size;
  :func:`check_placement` refuses what FSDP cannot do on the job's devices
  (a hybrid job of GPU and CPU ranks, CPU offload without GPUs or alone).
* :func:`training_state_bytes` is the planned per-rank memory of parameters,
  gradients and Adam's two moments; :func:`check_fits` refuses (in the launcher) a plan
  larger than what a rank may fill, naming it (under hsdp: one shard of a replica's state).

Gradient accumulation skips the reduce-scatter on all but the last micro-step
(``set_requires_gradient_sync``, FSDP2's ``no_sync``); ``clip_grad_norm_`` over
the DTensor gradients returns the norm of the whole (global) gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from multigpu.errors import ConfigError

__all__ = ["block_modules", "check_fits", "check_hsdp", "check_placement", "check_sharding", "compile_blocks",
           "device_mesh", "shard_model", "training_state_bytes"]

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


def compile_blocks(module: nn.Module, class_names: Iterable[str], device: torch.device) -> int:
    """``torch.compile`` each block in place (``Module.compile``: names and state-dict keys unchanged), before
    ``fully_shard``, so FSDP's all-gather and reduce-scatter hooks stay outside the compiled graphs (torchtitan's
    order). Returns the number of blocks compiled (0 on a CPU without a C++ compiler, said once)."""
    from multigpu.train.speed import can_compile

    if not can_compile(device):
        return 0
    blocks = block_modules(module, class_names)
    for block in blocks:
        block.compile()
    return len(blocks)


def check_hsdp(world_size: int, shard_size: int) -> None:
    """Raise a one-line ConfigError when ``shard_size`` ranks per replica do not tile ``world_size`` (pure)."""
    if shard_size < 1 or world_size % shard_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError(f"strategy=hsdp: hsdp_shard_size={shard_size} does not divide the world size {world_size} "
                          f"into whole replicas; valid: {', '.join(map(str, divisors))}")


def device_mesh(device: torch.device, world_size: int, shard_size: int | None = None):
    """The mesh of this rank's device type (never FSDP's default, which is CUDA's whenever a GPU is visible):
    1-D over every rank (fsdp), or 2-D ``(replicate, shard)`` with ``shard_size`` ranks per replica (hsdp:
    parameters sharded within a group of ranks, typically a node, and replicated across groups; consecutive
    ranks share a replica, so with torchrun's numbering a replica is one node)."""
    from torch.distributed.device_mesh import init_device_mesh

    if shard_size is None:
        return init_device_mesh(device.type, (world_size,))
    check_hsdp(world_size, shard_size)
    return init_device_mesh(device.type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))


class StepTraffic:
    """FSDP2's collectives of one optimizer step, for ``collectives.record_traffic`` (FSDP2 calls torch's
    collectives itself, so they are counted from the sharding, the same every step): per unit (each block, then
    the root's own parameters) one all-gather of its parameters per micro-step in forward, another in backward
    when blocks reshard after forward (the root never does), and one reduce-scatter of its fp32 gradients on the
    step that syncs. Bytes are whole units (``sharded_all_gather``, ``reduce_scatter``), which do not change
    with the world size. Under HSDP (``shard_size``) those run over the ranks of a replica (group ``shard``), and
    the gradient shards are then all-reduced across the replicas (group ``replicate``)."""

    def __init__(self, module: nn.Module, blocks: list[nn.Module], reshard_after_forward: bool,
                 param_dtype: torch.dtype | None, shard_size: int | None = None):
        def nbytes(params, dtype=None) -> int:
            return sum(p.numel() * (dtype.itemsize if dtype else p.element_size()) for p in params)

        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        root = [p for p in {id(p): p for p in module.parameters()}.values() if id(p) not in in_blocks]
        self.units = [(nbytes(b.parameters(), param_dtype), nbytes(b.parameters(), torch.float32),
                       2 if reshard_after_forward else 1) for b in blocks]
        if root:
            self.units.append((nbytes(root, param_dtype), nbytes(root, torch.float32), 1))
        self.hsdp = shard_size is not None

    def record(self, micro_steps: int) -> None:
        from multigpu.runtime.collectives import record_traffic

        within = "shard" if self.hsdp else None
        for gathered, grads, gathers in self.units:
            record_traffic("sharded_all_gather", gathered * gathers * micro_steps, calls=gathers * micro_steps,
                           group=within)
            record_traffic("reduce_scatter", grads, group=within)
            if self.hsdp:  # each rank's reduced shard, summed over the replicas (whole bytes: see record_traffic)
                record_traffic("all_reduce", grads, group="replicate")


def shard_model(module: nn.Module, optimizer: torch.optim.Optimizer, *, device: torch.device,
                class_names: Iterable[str] = (), reshard_after_forward: bool = True,
                param_dtype: torch.dtype | None = None, cpu_offload: bool = False, seed: int = 0,
                shard_size: int | None = None) -> StepTraffic:
    """``fully_shard`` each block, then the root; the optimizer is pointed at the sharded parameters.

    Call on all ranks, before the optimizer's first step. Returns what one optimizer step communicates.

    Args:
        module: The model, on the host (not yet on ``device``); it is changed in place, and each rank keeps
            its shard of every parameter on ``device`` (or in host memory with ``cpu_offload``).
        optimizer: Built on ``module``'s parameters (its state must still be empty).
        device: This rank's device; the mesh is of its type.
        class_names: Block classes to shard one by one (default: the model's repeated blocks).
        reshard_after_forward: Free each block's gathered parameters after its forward (less memory,
            one more all-gather in backward).
        param_dtype: Compute dtype of the gathered parameters (bf16 mixed precision); gradients are
            reduced in fp32 and the sharded parameters stay in their own dtype.
        cpu_offload: Keep the sharded parameters, gradients and optimizer state in host memory (GPUs).
        seed: For a model built on the meta device: the seed its shards are initialized from
            (:func:`multigpu.train.meta.materialize`).
        shard_size: HSDP: shard over groups of this many ranks and replicate across the groups (a 2-D mesh);
            None: shard over every rank.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if any(optimizer.state.values()):
        raise ConfigError(f"strategy={'hsdp' if shard_size else 'fsdp'}: the optimizer has already stepped; shard "
                          "before training starts")
    import torch.distributed as dist

    world_size = dist.get_world_size()
    check_sharding(module, shard_size or world_size, class_names, "hsdp" if shard_size else "fsdp")
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    options = {
        "mesh": device_mesh(device, world_size, shard_size),
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None),
        "offload_policy": CPUOffloadPolicy() if cpu_offload else OffloadPolicy(),
    }
    blocks = block_modules(module, class_names)
    traffic = StepTraffic(module, blocks, reshard_after_forward, param_dtype, shard_size)
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **options)
    fully_shard(module, **options)
    from multigpu.train.meta import is_on_meta, materialize

    if is_on_meta(module):  # built on meta: only now, sharded, does each rank get storage for its own rows
        materialize(module, torch.device("cpu") if cpu_offload else device, seed)  # offloaded shards: on the host
    new = dict(module.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [new[names[id(p)]] for p in group["params"]]
    return traffic
