"""The train workload as rank r of N: its share of the data, and one step on fake tensors (launcher side).

The data factory runs for real (its length and one batch's shapes); the model is built inside torch's
``FakeTensorMode`` (no memory), sharded with ``fully_shard`` on a device mesh of N fake ranks under
``strategy=fsdp`` (2-D, ``(replicate, shard)``, under ``strategy=hsdp``), and steps twice (forward, backward,
the optimizer; the second step has the optimizer state that every later step has) under torch's
``MemTracker`` (``FSDPMemTracker`` for fsdp and hsdp), which counts the bytes of the fake tensors alive at
each moment: parameters, gradients, optimizer state, activations.
DDP keeps its gradients in its buckets (``gradient_as_bucket_view``), so buckets add nothing here.
A model that cannot be built or stepped on fake tensors gets the planned figures of
:func:`multigpu.train.strategy_checks.training_state_bytes` instead (estimated), and no activation figure.
"""

from __future__ import annotations

import contextlib

import torch

from multigpu.errors import ConfigError
from multigpu.jobs.dryrun import Figure, Report, fake_world

__all__ = ["examine", "measure_step"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _context(cfg, vocab_size=None) -> dict:
    return {"block_size": cfg.block_size, "vocab_size": vocab_size}


def examine(cfg, plan, rank: int, report: Report) -> None:
    world = plan.world_size
    try:
        batch, accum = cfg.batch_per_rank(world), cfg.accum_per_rank(world)
    except ConfigError as exc:
        if str(exc) not in report.errors:
            report.errors.append(str(exc))
        return
    try:
        out = cfg.data.build("data.factory", _context(cfg))
    except ConfigError as exc:
        if str(exc) not in report.errors:
            report.errors.append(str(exc))
        return
    train = out[0] if isinstance(out, tuple) else out
    _shard(cfg, train, world, rank, batch, accum, report)
    from multigpu.train.config import shard_size

    shards = shard_size(cfg, plan)
    if shards is not None:
        report.lines.append(f"hsdp: {world // shards if world % shards == 0 else '?'} replica(s) × {shards} ranks "
                            f"(each rank holds 1/{shards} of the training state)")
    measure_step(cfg, train, world, rank, batch, report, shards)


def _shard(cfg, train, world: int, rank: int, batch: int, accum: int, report: Report) -> None:
    """Rank r's samples per epoch (torch's DistributedSampler rule, :class:`multigpu.TrainSampler`)."""
    import multigpu as mg

    report.lines.append(f"strategy {cfg.strategy}; batch {batch} × grad_accum {accum} × world_size {world} = "
                        f"{batch * accum * world:,} samples per step")
    try:
        sampler = mg.TrainSampler(train, seed=cfg.seed, rank=rank, world_size=world)
    except (ConfigError, ValueError) as exc:
        report.errors.append(str(exc))
        return
    batches = sampler.num_samples // batch
    report.lines.append(f"data: {len(train):,} samples; rank {rank} gets {sampler.num_samples:,} per epoch = "
                        f"{batches:,} micro-batches of {batch}")
    if batches == 0:  # the trainer's loader refuses this (multigpu.train.loader)
        report.errors.append(f"each rank gets {sampler.num_samples} samples per epoch, fewer than batch_size={batch}; "
                             "use a smaller batch or more data")


def _collate(train, batch: int):
    from torch.utils.data import default_collate

    return default_collate([train[i % len(train)] for i in range(batch)])


def measure_step(cfg, train, world: int, rank: int, batch: int, report: Report, shard_size: int | None = None) -> None:
    """Two training steps of rank ``rank`` on fake tensors; the figures go into ``report``. ``shard_size``: hsdp's
    ranks per replica."""
    import torch.distributed as dist

    if dist.is_initialized():  # a process group already here (tests in one process): do not replace it
        raise RuntimeError("the dry run needs this process to have no process group")
    with fake_world(rank, world):
        try:
            figures, peak = _fake_steps(cfg, train, world, batch, shard_size=shard_size)
        except ConfigError as exc:
            report.errors.append(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a model fake tensors cannot run: planned figures instead
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            report.warnings.append(f"one step on fake tensors failed ({type(exc).__name__}: {first[:200]}); "
                                   "parameters, gradients and optimizer state are the planned figures, "
                                   "activations are not measured")
            figures, peak = _planned(cfg, train, world, shard_size), None
    report.memory.extend(figures)
    if peak is None:
        state = sum(f.bytes for f in figures if f.bytes is not None)
        peak = Figure("training state (no activations)", state, "estimated")
    report.memory.append(peak)
    report.peak = peak
    if cfg.compile:
        report.warnings.append("compile=true: measured in eager mode (torch.compile may fuse and save memory)")
    if cfg.activation_checkpointing:
        report.warnings.append("activation_checkpointing=true: activations were measured without it (an upper bound)")


def _planned(cfg, train, world: int, shard_size: int | None = None) -> list[Figure]:
    from multigpu.train.strategy_checks import training_state_bytes

    with torch.device("meta"):
        model = cfg.model.build("model.factory", _context(cfg, getattr(train, "vocab_size", None)))
    plan = training_state_bytes(model.to(_DTYPES[cfg.dtype]), shard_size or world, cfg.strategy != "ddp")
    note = "from parameter shapes"
    return [Figure("parameters", plan["params"], "estimated", note), Figure("gradients", plan["grads"], "estimated", note),
            Figure("optimizer state", plan["optimizer"], "estimated", "AdamW: 2 moments")]


def _fake_steps(cfg, train, world: int, batch: int, *, fake: bool = True,
                shard_size: int | None = None) -> tuple[list[Figure], Figure]:
    """Two steps under the tracker; ``fake=False`` runs them on real CPU tensors (what the tests compare with).
    ``shard_size``: hsdp's ranks per replica (a 2-D ``(replicate, shard)`` mesh, as the trainer makes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._pytree import tree_map

    from multigpu.factory import import_object
    from multigpu.train.optim import make_optimizer
    from multigpu.train.trainer import default_loss

    real = _collate(train, batch)
    sharded = cfg.strategy != "ddp"
    mesh = None
    if sharded:  # made outside fake mode: init_device_mesh needs real values
        from multigpu.train.strategies import device_mesh

        mesh = device_mesh(torch.device("cpu"), world, shard_size if cfg.strategy == "hsdp" else None)
    loss_fn = import_object(cfg.loss, what="loss", callable_only=True) if cfg.loss else default_loss
    precision = _DTYPES[cfg.precision]
    with FakeTensorMode() if fake else contextlib.nullcontext() as mode:
        model = _build_in(cfg, train, _DTYPES[cfg.dtype])
        optimizer = make_optimizer(model, cfg)
        if sharded:
            optimizer = _shard_model(cfg, model, optimizer, mesh, precision)
            tracker = FSDPMemTracker(model, optimizer)
        else:
            tracker = MemTracker()
            tracker.track_external(model, optimizer)
        fake_batch = tree_map(lambda t: mode.from_tensor(t) if fake and isinstance(t, torch.Tensor) else t, real)
        autocast = (torch.autocast("cpu", dtype=precision) if precision != torch.float32 else contextlib.nullcontext())
        with tracker:
            for step in range(2):  # the second step has the optimizer state that every later step has
                if step:
                    tracker.reset_mod_stats()  # the tracker's per-module figures are per step; its peak stays
                with autocast:
                    loss = loss_fn(model, fake_batch)
                loss.backward()
                optimizer.step()
                now = _categories(tracker.get_tracker_snapshot("current"))
                optimizer.zero_grad(set_to_none=True)
        peak = _categories(tracker.get_tracker_snapshot("peak"))
    how = "measured"
    figures = [Figure("parameters", now["params"], how, "this rank's shard" if sharded else "a whole replica"),
               Figure("gradients", now["grads"], how), Figure("optimizer state", now["opt"], how, type(optimizer).__name__)]
    if now["buffers"]:
        figures.append(Figure("buffers", now["buffers"], how))
    if sharded:
        figures.append(Figure("gathered parameters + collective buffers (at peak)", peak["gathered"], how))
    figures.append(Figure("activations (at peak)", peak["act"], how, f"batch {batch}, precision {cfg.precision}"))
    return figures, Figure("peak of a training step", peak["total"], how, "one step on fake tensors")


def _build_in(cfg, train, dtype):
    """The model with its floating-point parameters in ``dtype`` (made so: ``Module.to`` cannot swap fake
    parameters)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return cfg.model.build("model.factory", _context(cfg, getattr(train, "vocab_size", None)))
    finally:
        torch.set_default_dtype(previous)


def _shard_model(cfg, model, optimizer, mesh, precision):
    """:func:`multigpu.train.strategies.shard_model`'s sharding on an explicit mesh (its own would call
    ``init_device_mesh``, which cannot run on fake tensors)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from multigpu.train.strategy_checks import block_modules, check_sharding

    shards = mesh.size(mesh.ndim - 1)  # hsdp: the ranks of one replica (the mesh's last dimension)
    check_sharding(model, shards, cfg.fsdp_blocks, cfg.strategy)
    param_dtype = precision if precision != torch.float32 else None
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    for block in block_modules(model, cfg.fsdp_blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=cfg.fsdp_reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    new = dict(model.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        group["params"] = [new[names[id(p)]] for p in group["params"]]
    return optimizer


def _categories(snapshot: dict) -> dict[str, int]:
    """MemTracker's per-device categories summed over devices into ours."""
    out = dict.fromkeys(("params", "grads", "opt", "act", "buffers", "gathered", "total"), 0)
    kinds = {"SHARDED_PARAM": "params", "PARAM": "params", "SHARDED_GRAD": "grads", "GRAD": "grads",
             "UNSHARDED_GRAD": "grads", "OPT": "opt", "ACT": "act", "TEMP": "act", "BUFFER": "buffers",
             "UNSHARDED_PARAM": "gathered", "ALL_GATHER": "gathered", "REDUCE_SCATTER": "gathered",
             "Total": "total"}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "name", str(key))
            if name in kinds:
                out[kinds[name]] += int(value)
    return out
