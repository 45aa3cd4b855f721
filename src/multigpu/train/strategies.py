"""Training strategies (inside each rank): how the model is spread over the ranks and its gradients synced.

Lightning Fabric's shape: a :class:`~multigpu.train.Trainer` holds one :class:`Strategy`, made by
:func:`strategy_for` from ``TrainConfig.strategy``, and asks it instead of testing the strategy's name:

=======================================  ==========================================================================
``setup(module, optimizer, init)``       place and wrap the model (DDP, or FSDP2's ``fully_shard``); the model to call
``no_backward_sync(enabled)``            around an accumulation micro-step whose gradients are not synced yet
``clip_gradients(module, max_norm)``     clip to the norm of the whole (global) gradient, and return it
``record_comm(meter, micro_steps)``      what a step communicated, to the step meter
``checkpoint_parts`` / ``restore``       what a checkpoint holds, and loading it back into this job's layout
``eval_batches(starts)``                 the validation batches a rank runs
=======================================  ==========================================================================

* :class:`DDP` (``strategy: ddp``): a whole replica of the model, its gradients and its optimizer state on every
  rank; gradients all-reduced in backward (:func:`wrap_ddp`, with the ``sync_backend`` below).
* :class:`FSDP` (``strategy: fsdp``): each rank keeps ``1/world_size`` of every parameter (a ``Shard(0)``
  DTensor), of its gradient and of the optimizer state built on it; a block's full parameters exist only while
  the block runs (all-gathered before its forward and backward, freed after): :func:`shard_model`.
* :class:`HSDP` (``strategy: hsdp``): FSDP within groups of ``hsdp_shard_size`` ranks (default: a node's), the
  groups replicas of each other, on a 2-D ``(replicate, shard)`` mesh (:func:`device_mesh`).

On one rank none of them wraps the model (everything else is the same code), and FSDP and HSDP still write their
checkpoints as DCP shards: a run saved on N ranks resumes on any number of ranks, mesh and strategy (DCP reshards
on load; :class:`FsdpTensors`); a ddp checkpoint (whole state dicts) resumes under ddp only. What each strategy
needs and holds, checked before anything runs, is :mod:`multigpu.train.strategy_checks`.

**DDP's gradient sync backends** (``sync_backend``):

* ``auto``  - the process group's own: NCCL between GPUs, gloo on CPU ranks.
* ``nccl``  - NCCL; every rank must be on a GPU.
* ``gloo``  - gloo, through a separate gloo group when the default group is NCCL.
* ``cpu``   - a DDP communication hook that copies each gradient bucket to host
  memory, all-reduces it over a gloo group, and copies the average back: a job
  whose GPUs cannot talk to each other directly still trains correctly. It is
  synchronous (no overlap with the backward pass); it exists for correctness.

Every hook divides by ``world_size`` before the sum, as DDP's default hook does,
so ``gloo`` and ``cpu`` give bit-identical gradients. The gloo and cpu hooks
time their all-reduces: ``CommTimer.pop_seconds()`` is the time gradient
all-reduces were in flight during a step (the union over buckets; on gloo it
overlaps the backward compute). NCCL runs DDP's built-in hook, untimed: its
futures complete when the kernels are queued, not when they finish, so a
timed hook would report queueing time. There ``wrap_ddp`` returns
:class:`NotTimed`, whose ``pop_seconds()`` is None: the step meter then
reports communication as not measured, never as 0.

**FSDP2** (:func:`shard_model`) applies ``fully_shard`` per block (the model's repeated blocks,
:func:`multigpu.train.speed.find_blocks`, or the classes named in ``fsdp_blocks``), then to the root, over a mesh
of this rank's device type (``init_device_mesh``: FSDP's default mesh is CUDA's whenever a GPU is visible, which
would put a CPU rank's parameters on ``cuda:0``), and points the optimizer at the new (sharded) parameters. It is
given the model on the host: ``fully_shard`` moves one block at a time to the device and keeps this rank's shard
of it, so the whole unsharded model never has to fit on a GPU. Given a model built on the ``meta`` device (as
``multigpu train`` builds it), it materializes only this rank's shards (:mod:`multigpu.train.meta`): no rank ever
holds the whole model, in host memory or on a GPU. Gradient accumulation skips the reduce-scatter on all but the
last micro-step (``set_requires_gradient_sync``, FSDP2's ``no_sync``); ``clip_grad_norm_`` over the DTensor
gradients returns the norm of the whole (global) gradient. FSDP2's all-gathers and reduce-scatters are torch's
own, timed by nobody: a sharded step's communication is "not measured", and what it moves is counted from the
sharding (:class:`StepTraffic`, for ``multigpu bench --predict``).
"""

# no ``from __future__ import annotations``: DDP checks that a comm hook's ``bucket`` is annotated with the
# dist.GradBucket class itself (register_comm_hook), not with its name
import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from multigpu.checkpoint import PerRank, Sharded
from multigpu.errors import ConfigError, DeviceError
from multigpu.runtime.collectives import record_traffic
from multigpu.runtime.group import DistEnv
from multigpu.train.config import TrainConfig
from multigpu.train.strategy_checks import block_modules, check_hsdp, check_placement, check_sharding

__all__ = ["DDP", "FSDP", "HSDP", "STRATEGIES", "CommTimer", "FsdpTensors", "NotTimed", "StepTraffic", "Strategy",
           "compile_blocks", "cpu_allreduce_hook", "device_mesh", "shard_model", "strategy_for",
           "timed_allreduce_hook", "wrap_ddp"]


# ----------------------------------------------------------------------------- the strategies
class Strategy:
    """A whole model on this rank, nothing wrapped: one rank's training, and what the strategies below share.

    Args:
        cfg: The training config (its ``strategy``, precision, ``fsdp_*`` and ``sync_backend`` keys).
        env: This rank's place in the job (``mg.init``'s).
    """

    name = "ddp"
    """The ``strategy`` config value."""
    shards = False
    """Whether this kind shards the model's tensors over the ranks (on 2 or more)."""

    def __init__(self, cfg: TrainConfig, env: DistEnv):
        self.cfg, self.env = cfg, env
        self.sharded = self.shards and env.world_size > 1
        """The parameters, gradients and optimizer state are sharded over the ranks (fsdp, hsdp on 2 or more)."""
        self.shard_size: int | None = None
        """hsdp: the ranks of one replica; None otherwise."""
        self.module: nn.Module | None = None

    @property
    def autocast_precision(self) -> str:
        """The precision forward passes autocast to (under FSDP its mixed-precision policy casts instead)."""
        return self.cfg.precision

    # ------------------------------------------------------------------ wrap
    def setup(self, module: nn.Module, optimizer: torch.optim.Optimizer, init: Callable[[], None] = lambda: None
              ) -> nn.Module:
        """Place ``module`` on this rank's device, in place (the optimizer keeps its parameters, or is pointed at
        the sharded ones), and wrap it. ``init`` loads the starting weights (``init_from``): called where every
        rank holds what it reads (the whole model before DDP wraps it; its shards once FSDP has cut them).
        Returns the model to call (wrapped, compiled). Call on all ranks."""
        from multigpu.train.meta import is_on_meta, materialize
        from multigpu.train.optim import use_fused
        from multigpu.train.precision import DTYPES

        cfg, device = self.cfg, self.env.device
        self.module = module
        if is_on_meta(module):  # built on meta, not sharded here: all of it on this rank
            materialize(module, device, cfg.seed, optimizer)
        module.to(device=device, dtype=DTYPES[cfg.dtype])  # in place: the optimizer keeps its parameters
        _checkpoint_activations(module, cfg)
        init()  # every rank holds the same whole weights
        use_fused(optimizer)
        model = self.wrap(module)
        if cfg.compile:  # after DDP, as DDP's documentation orders: its bucketed all-reduce overlaps the graph
            from multigpu.train.speed import compiled

            model = compiled(model, device)
        return model

    def wrap(self, module: nn.Module) -> nn.Module:
        """The model on this rank, wrapped for the job (here: as it is)."""
        return module

    # ------------------------------------------------------------------ a step
    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Around an accumulation micro-step (forward and backward) whose gradients are not synced yet (``enabled``:
        not the last micro-step of the optimizer step)."""
        return contextlib.nullcontext()

    def clip_gradients(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``module``'s parameters to ``max_norm`` (inf: measure only); returns the norm of
        the whole gradient (the gradients are already averaged; under FSDP the shards' norms over every rank)."""
        norm = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm).detach()
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def record_comm(self, meter: Any, micro_steps: int) -> None:
        """After an optimizer step of ``micro_steps`` micro-steps: what it communicated outside multigpu's own
        collectives, to the step meter (:meth:`~multigpu.monitor.StepMeter.add_comm`)."""

    def eval_batches(self, starts: list[int]) -> list[int | None]:
        """The validation batches this rank runs: its own (``starts``), and where every forward is a collective
        (sharded) as many as the rank with the most, the extra ones None (run, not counted)."""
        return list(starts)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_parts(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                         trainer_state: Callable[[], dict]) -> dict[str, Any]:
        """What a checkpoint holds besides every rank's random state: the model's and the optimizer's whole state
        dicts (rank 0's) and the trainer's own state (``trainer_state()``, taken as the checkpoint is)."""
        return {"model": module, "optimizer": optimizer, "trainer": _Later(trainer_state)}

    def checkpoint_meta(self, module: nn.Module) -> dict[str, Any]:
        """What the manifest records for the launcher to check a resume by: the parameter shapes."""
        from multigpu.train.checkpoint import param_shapes

        return {"params": param_shapes(module.state_dict())}

    def checkpoint_reads(self, path) -> dict[str, Any]:
        """A resume's first step: the parts to read of checkpoint ``path`` (:meth:`multigpu.run.Run.read`), by
        what it holds, whatever this strategy writes: DCP shards (written under fsdp or hsdp) load into any
        layout and strategy, whole state dicts (ddp's) into a whole model only (one line under fsdp, hsdp)."""
        from multigpu.train.checkpoint import check_layout

        sharded = check_layout(path, self.name)
        return {"trainer": None, "rng": PerRank(None), **({} if sharded else {"model": None, "optimizer": None})}

    def restore(self, run: Any, saved: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """A resume's second step: the model's and the optimizer's tensors from ``saved`` (whole state dicts), or
        each rank's own shards read from the checkpoint, resharded to this job's layout (:meth:`Run.apply
        <multigpu.run.Run.apply>`). Call on all ranks."""
        if "model" in saved:
            run.apply(saved, {"model": module, "optimizer": optimizer})
        else:
            tensors = FsdpTensors(module, optimizer, saved["trainer"]["param_groups"])
            run.apply(saved, {"tensors": Sharded(tensors)})

    # ------------------------------------------------------------------ what it holds
    def memory_plan(self, module: nn.Module) -> tuple[dict[str, int], str]:
        """The planned bytes per rank of parameters, gradients and Adam state, and how they are held."""
        from multigpu.train.strategy_checks import training_state_bytes

        return training_state_bytes(module, self.env.world_size, False), "a whole replica"

    def summary(self) -> dict[str, Any]:
        """What ``summary.json`` says of the strategy."""
        return {"strategy": self.name}


class DDP(Strategy):
    """``strategy: ddp``: a whole replica per rank, gradients all-reduced in backward (:func:`wrap_ddp`, with the
    config's ``sync_backend``). One rank: no DDP."""

    name = "ddp"

    def __init__(self, cfg: TrainConfig, env: DistEnv):
        super().__init__(cfg, env)
        self.ddp: DistributedDataParallel | None = None
        """The DDP wrapper (None on one rank)."""
        self.comm: CommTimer | NotTimed | None = None
        """What times its gradient all-reduces (None on one rank)."""

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.env.world_size == 1:
            return module
        self.ddp, self.comm = wrap_ddp(module, self.env, self.cfg.sync_backend,
                                       find_unused_parameters=self.cfg.find_unused_parameters,
                                       bucket_cap_mb=self.cfg.bucket_cap_mb)
        return self.ddp

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        # DDP prepares its reducer in forward: no_sync covers the forward too
        return self.ddp.no_sync() if enabled and self.ddp is not None else contextlib.nullcontext()

    def record_comm(self, meter: Any, micro_steps: int) -> None:
        if self.comm is not None:
            meter.add_comm(self.comm.pop_seconds())


class FSDP(Strategy):
    """``strategy: fsdp``: parameters, gradients and optimizer state sharded over every rank (:func:`shard_model`);
    checkpoints are DCP shards on any world size. One rank: nothing is sharded (the whole model, as ddp's)."""

    name = "fsdp"
    shards = True

    def __init__(self, cfg: TrainConfig, env: DistEnv, *, hybrid: bool = False):
        super().__init__(cfg, env)
        check_placement(env.world_size, ["cuda", "cpu"] if hybrid else [env.device.type], cfg.fsdp_cpu_offload,
                        self.name)
        self.traffic: StepTraffic | None = None
        """What one optimizer step communicates (counted for ``bench --predict``; None when not sharded)."""

    @property
    def autocast_precision(self) -> str:
        return "fp32" if self.sharded else self.cfg.precision  # sharded: FSDP's mixed-precision policy casts

    def setup(self, module: nn.Module, optimizer: torch.optim.Optimizer, init: Callable[[], None] = lambda: None
              ) -> nn.Module:
        if not self.sharded:
            return super().setup(module, optimizer, init)
        from multigpu.train.optim import use_fused
        from multigpu.train.precision import DTYPES

        cfg = self.cfg
        self.module = module
        # the whole model never goes to the device: fully_shard moves one block at a time there and keeps only
        # this rank's shard of it
        module.to(dtype=DTYPES[cfg.dtype])
        _checkpoint_activations(module, cfg)
        if cfg.compile:  # per block, before sharding (torchtitan's order): FSDP's hooks stay outside the graphs
            compile_blocks(module, cfg.fsdp_blocks, self.env.device)
        param_dtype = DTYPES[cfg.precision] if cfg.precision != "fp32" else None
        self.traffic = shard_model(module, optimizer, device=self.env.device, class_names=cfg.fsdp_blocks,
                                   param_dtype=param_dtype, reshard_after_forward=cfg.fsdp_reshard_after_forward,
                                   cpu_offload=cfg.fsdp_cpu_offload, seed=cfg.seed, shard_size=self.shard_size)
        init()  # each rank reads its own rows of every parameter
        use_fused(optimizer)  # on the sharded parameters (unless offloaded to the host)
        return module

    def no_backward_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if self.sharded:  # FSDP2's no_sync: keep unsharded gradients until the last micro-step's reduce-scatter
            self.module.set_requires_gradient_sync(not enabled)
        return contextlib.nullcontext()

    def record_comm(self, meter: Any, micro_steps: int) -> None:
        if self.traffic is not None:
            self.traffic.record(micro_steps)
            meter.add_comm(None)  # FSDP's all-gathers and reduce-scatters are torch's: nobody times them

    def eval_batches(self, starts: list[int]) -> list[int | None]:
        if not self.sharded:
            return list(starts)
        from multigpu.runtime.collectives import all_reduce

        # every forward all-gathers parameters: all ranks run as many batches (the extra ones count 0)
        most = int(all_reduce(torch.tensor([len(starts)]), "max", check_shapes=False).item())
        return [*starts, *[None] * (most - len(starts))]

    def checkpoint_parts(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                         trainer_state: Callable[[], dict]) -> dict[str, Any]:
        """Every rank writes its shards of the model and the optimizer (DCP); the optimizer's ``param_groups``
        (plain values) travel in the trainer's part, taken after the shards (the store takes sharded parts first)."""
        tensors = FsdpTensors(module, optimizer)
        return {"tensors": Sharded(tensors),
                "trainer": _Later(lambda: {**trainer_state(), "param_groups": tensors.saved_param_groups})}

    def checkpoint_meta(self, module: nn.Module) -> dict[str, Any]:
        return {}  # the shards' shapes are DCP's, checked as they load

    def memory_plan(self, module: nn.Module) -> tuple[dict[str, int], str]:
        if not self.sharded:
            return super().memory_plan(module)
        from multigpu.train.strategy_checks import training_state_bytes

        shards = self.shard_size or self.env.world_size
        how = f"sharded over {shards} ranks"
        if self.shard_size is not None:  # hsdp: the same shards in every replica
            replicas = self.env.world_size // shards
            how += f" of a replica, {replicas} replica{'s' if replicas > 1 else ''}"
        return training_state_bytes(module, shards, True), how


class HSDP(FSDP):
    """``strategy: hsdp``: FSDP within groups of ``hsdp_shard_size`` ranks (default: the ranks of a node), the groups
    replicas of each other (a 2-D ``(replicate, shard)`` mesh: :func:`device_mesh`)."""

    name = "hsdp"

    def __init__(self, cfg: TrainConfig, env: DistEnv, *, hybrid: bool = False):
        super().__init__(cfg, env, hybrid=hybrid)
        self.shard_size = cfg.hsdp_shard_size or env.local_world_size

    def summary(self) -> dict[str, Any]:
        # bench --predict: the shard group, and whether it was chosen or a node's
        return {**super().summary(), "hsdp": {"shard_size": self.shard_size, "set": self.cfg.hsdp_shard_size is not None}}


STRATEGIES: dict[str, type[Strategy]] = {"ddp": DDP, "fsdp": FSDP, "hsdp": HSDP}
"""The strategy class of each ``strategy`` config value."""


def strategy_for(cfg: TrainConfig, env: DistEnv, *, hybrid: bool = False) -> Strategy:
    """The strategy ``cfg.strategy`` names, for this rank (``hybrid``: the job has GPU and CPU ranks, which a
    sharded model refuses in one line)."""
    kind = STRATEGIES[cfg.strategy]
    return kind(cfg, env) if kind is DDP else kind(cfg, env, hybrid=hybrid)


def _checkpoint_activations(module: nn.Module, cfg: TrainConfig) -> None:
    if cfg.activation_checkpointing:
        from multigpu.train.speed import checkpoint_blocks

        checkpoint_blocks(module)


class _Later:
    """A plain checkpoint part computed when the store takes it (after the sharded parts)."""

    def __init__(self, make: Callable[[], dict]):
        self.make = make

    def state_dict(self) -> dict:
        return self.make()


class FsdpTensors:
    """The sharded (fsdp, hsdp) model and optimizer as one checkpoint part (``Sharded(FsdpTensors(...))``):
    ``{"model": ..., "optim": ...}``, this rank's shards in torch's distributed state-dict layout, written by every
    rank through DCP (the replicas of hsdp hold equal shards: DCP writes each once) and resharded on load to any
    number of ranks and mesh, or a whole model under ddp. The optimizer's ``param_groups`` (plain values) travel
    in the trainer's plain part and are handed back (``param_groups``) before the tensors are loaded."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, param_groups: list | None = None):
        self.module, self.optimizer, self.param_groups = module, optimizer, param_groups
        self.saved_param_groups: list | None = None
        """The optimizer's ``param_groups`` at the last ``state_dict()`` (what a checkpoint records beside it)."""

    def state_dict(self) -> dict[str, Any]:
        """This job's layout (on load: the template DCP fills in place; it also initializes the optimizer state)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.module, self.optimizer)
        self.saved_param_groups = optim_sd["param_groups"]
        return {"model": model_sd, "optim": optim_sd["state"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        groups = self.param_groups if self.param_groups is not None else self.saved_param_groups
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict={"state": state["optim"], "param_groups": groups})


# ----------------------------------------------------------------------------- DDP and its gradient sync
class CommTimer:
    """The group to all-reduce over, and the intervals gradient all-reduces were in flight."""

    def __init__(self, group, world_size: int):
        self.group = group
        self.world_size = world_size
        self._intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def add(self, start: float, end: float) -> None:
        with self._lock:
            self._intervals.append((start, end))

    def pop_seconds(self) -> float:
        """Seconds covered by the recorded intervals (overlaps counted once); clears them."""
        with self._lock:
            spans, self._intervals = sorted(self._intervals), []
        total, cur_start, cur_end = 0.0, None, None
        for start, end in spans:
            if cur_end is None or start > cur_end:
                total += (cur_end - cur_start) if cur_end is not None else 0.0
                cur_start, cur_end = start, end
            else:
                cur_end = max(cur_end, end)
        return total + ((cur_end - cur_start) if cur_end is not None else 0.0)


class NotTimed:
    """DDP's own NCCL all-reduce: it communicates every step, and no host clock can time it."""

    def pop_seconds(self) -> None:
        return None


def timed_allreduce_hook(state: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (average, asynchronous), timed from launch to completion."""
    start = time.perf_counter()
    buf = bucket.buffer().div_(state.world_size)
    record_traffic("all_reduce", buf.numel() * buf.element_size())
    fut = dist.all_reduce(buf, group=state.group, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        state.add(start, time.perf_counter())
        return f.value()[0]

    return fut.then(done)


def cpu_allreduce_hook(state: CommTimer, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Stage the bucket through host memory and average it over a gloo group, then copy it back."""
    start = time.perf_counter()
    buf = bucket.buffer()
    record_traffic("all_reduce", buf.numel() * buf.element_size())
    host = buf.to("cpu", copy=True)  # a real copy even on CPU ranks, so this path is what runs on GPUs
    host.div_(state.world_size)
    dist.all_reduce(host, group=state.group)
    buf.copy_(host)
    state.add(start, time.perf_counter())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _gloo_group(env: DistEnv):
    """The default group when it is gloo, else a new gloo group beside NCCL (call on all ranks)."""
    return None if env.backend == "gloo" else dist.new_group(backend="gloo")


def wrap_ddp(
    module: torch.nn.Module,
    env: DistEnv,
    sync_backend: str,
    *,
    find_unused_parameters: bool = False,
    bucket_cap_mb: float = 25.0,
) -> tuple[DistributedDataParallel, CommTimer | NotTimed]:
    """Wrap ``module`` (already on ``env.device``) in DDP with the chosen sync backend. Call on all ranks.

    Returns DDP and what times its gradient all-reduces (``NotTimed`` on NCCL: see the module docstring)."""
    on_gpu = env.device.type == "cuda"
    if sync_backend == "nccl" and env.backend != "nccl":
        raise DeviceError(f"sync_backend=nccl needs every rank on its own GPU, but this job's collectives run on "
                          f"{env.backend} (a hybrid job, or ranks sharing a GPU); valid here: auto, gloo, cpu")
    ddp = DistributedDataParallel(
        module,
        device_ids=[env.device.index] if on_gpu else None,
        find_unused_parameters=find_unused_parameters,
        bucket_cap_mb=bucket_cap_mb,
        gradient_as_bucket_view=True,  # gradients live in the buckets: no copy in before, or out after, the all-reduce
        process_group=_gloo_group(env) if sync_backend == "gloo" else None,
    )
    if sync_backend == "cpu":
        timer = CommTimer(_gloo_group(env), env.world_size)
        ddp.register_comm_hook(timer, cpu_allreduce_hook)
    elif env.backend == "gloo" or sync_backend == "gloo":
        timer = CommTimer(ddp.process_group, env.world_size)
        ddp.register_comm_hook(timer, timed_allreduce_hook)
    else:
        timer = NotTimed()
    return ddp, timer


# ----------------------------------------------------------------------------- FSDP2
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
