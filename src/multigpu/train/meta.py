"""Build a model without memory, then give each rank only its own shards (inside each rank).

Under ``strategy: fsdp`` (or ``hsdp``) no rank ever holds the whole model (on one rank the same
build is materialized whole, with the same values):

1. :func:`build_on_meta` runs the model factory under ``torch.device("meta")``:
   parameters and buffers have shapes and no storage.
2. ``fully_shard`` (:func:`multigpu.train.strategies.shard_model`) cuts each meta
   parameter into this rank's ``Shard(0)`` DTensor, still on meta.
3. :func:`materialize` gives the shards storage on the device (``to_empty``) and
   fills them, one parameter (or one module) at a time: a full copy of that one
   tensor is made in host memory, and this rank keeps its rows of it. The peak
   is the shards plus the largest single module, never the model.

How the values are made (the same on 1, 2 or 3 ranks in every case):

* the model has ``init_parameter(name, tensor)`` (the built-in GPT): it fills
  the whole ``tensor`` of parameter ``name``; the result equals a build on the
  host (the GPT draws each parameter from its own generator, keyed by a seed
  drawn at construction and the parameter's name, so order does not matter);
* a Hugging Face model (``PreTrainedModel``): its ``_init_weights(module)`` per
  module, children first (as ``from_config`` does), from ``torch.manual_seed(seed)``;
  rotary buffers are recomputed there. Random values are a fresh draw, not a
  host build's (``from_config`` also draws in its constructors, which a meta
  build skips);
* any other model: each module's ``reset_parameters()`` (torch's layers have it),
  children first, from ``torch.manual_seed(seed)``. A module with parameters or
  buffers of its own and no ``reset_parameters`` is refused in one line, as is a
  factory that cannot run on meta (it reads a parameter's values: ``.item()``,
  data-dependent init).

What a model factory must support, then: build on the meta device, and name how
its tensors are initialized (one of the three above). Pretrained weights skip
the initialization: :mod:`multigpu.train.pretrained` reads each rank's rows of
a safetensors file instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from multigpu.errors import ConfigError

__all__ = ["META_HELP", "build_on_meta", "check_initializable", "copy_full", "is_on_meta", "materialize"]

META_HELP = ("strategy=fsdp (or hsdp) builds the model on the meta device (no memory) and materializes only this rank's "
             "shards, so the factory must create its parameters without reading their values (no .item(), no "
             "data-dependent init); valid: such a factory, or strategy=ddp")


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
          "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")
"""``torch.nn.init``'s in-place initializers: on meta tensors they write nothing, yet run through torch's
reference implementations, which import ``torch._dynamo`` (and sympy): seconds of a launcher's start-up."""


@contextlib.contextmanager
def _no_init_on_meta() -> Iterator[None]:
    """The initializers above return a meta tensor untouched (its values do not exist anyway)."""
    originals = {name: getattr(nn.init, name) for name in _INITS if hasattr(nn.init, name)}

    def skipping(original):
        def init(tensor, *args, **kwargs):
            return tensor if getattr(tensor, "is_meta", False) else original(tensor, *args, **kwargs)

        return init

    try:
        for name, original in originals.items():
            setattr(nn.init, name, skipping(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(nn.init, name, original)


def build_on_meta(build: Callable[[], nn.Module], factory: str) -> nn.Module:
    """``build()`` under ``torch.device("meta")``; a factory that cannot run there is one ConfigError line."""
    try:
        with torch.device("meta"), _no_init_on_meta():
            return build()
    except Exception as exc:  # noqa: BLE001 - the user's factory can fail in any way (Factory.build: a ConfigError)
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not isinstance(exc, ConfigError):
            why = f"{type(exc).__name__}: {why}"
        raise ConfigError(f"model.factory {factory!r} cannot be built on the meta device ({why}); {META_HELP}") from None


def is_on_meta(module: nn.Module) -> bool:
    """True when any parameter or buffer of ``module`` has no storage (built on meta, not yet materialized)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write ``full`` (the whole tensor, in host memory) into ``param``: this rank's rows when it is a DTensor.

    The split is DTensor's own (``distribute_tensor`` without a source rank: no communication), so it is
    right for any mesh and placement FSDP chose (1-D, or HSDP's replicate × shard)."""
    if hasattr(param, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
        param.to_local().copy_(mine)
    else:
        param.copy_(full)


def _full_like(t: torch.Tensor) -> torch.Tensor:
    """An empty whole-size host tensor for ``t`` (a DTensor shard or a plain tensor); fp32 for floating dtypes,
    so the values drawn do not depend on the parameter dtype (they are cast on copy, as ``.to(dtype)`` would)."""
    dtype = torch.float32 if t.dtype.is_floating_point else t.dtype
    return torch.empty(t.shape, dtype=dtype, device="cpu")


def materialize(module: nn.Module, device: torch.device, seed: int,
                optimizer: torch.optim.Optimizer | None = None) -> str:
    """Give a meta-built (and possibly sharded) ``module`` storage on ``device`` and its initial values.

    Call on all ranks (no communication; every rank draws the same values). ``optimizer`` (built on the meta
    parameters, never stepped) is pointed at the materialized ones. Returns how the values were made:
    "init_parameter", "hf _init_weights" or "reset_parameters". Raises ConfigError for a module that cannot
    be initialized after a meta build.
    """
    how = _init_kind(module)
    ties = _tied(module)
    names = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    module.to_empty(device=device)
    for owner, attr, first in ties:  # to_empty gives each name its own tensor: tied ones share one again
        owner._parameters[attr] = module.get_parameter(first)
    if optimizer is not None:  # to_empty may replace parameter objects: the optimizer gets the new ones
        new = dict(module.named_parameters(remove_duplicate=False))
        for group in optimizer.param_groups:
            group["params"] = [new[names[id(p)]] for p in group["params"]]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if how == "init_parameter":
            for name, param in module.named_parameters():  # tied parameters once
                full = _full_like(param)
                module.init_parameter(name, full)
                copy_full(param, full)
        else:
            init = module._init_weights if how == "hf _init_weights" else _reset
            for child in _children_first(module):
                with _whole(child):
                    init(child)
    return how


def check_initializable(module: nn.Module) -> None:
    """Raise a one-line ConfigError when :func:`materialize` could not make ``module``'s values (pure)."""
    _init_kind(module)


def _tied(module: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """(module, attribute, first name) for every parameter name that shares its tensor with an earlier name."""
    first: dict[int, str] = {}
    ties = []
    for name, param in module.named_parameters(remove_duplicate=False):
        seen = first.setdefault(id(param), name)
        if seen != name:
            owner, _, attr = name.rpartition(".")
            ties.append((module.get_submodule(owner), attr, seen))
    return ties


def _init_kind(module: nn.Module) -> str:
    if callable(getattr(module, "init_parameter", None)):
        return "init_parameter"
    if callable(getattr(module, "_init_weights", None)) and hasattr(module, "config"):
        return "hf _init_weights"
    for name, child in module.named_modules():
        own = [*child.parameters(recurse=False), *child.buffers(recurse=False)]
        if own and not callable(getattr(child, "reset_parameters", None)):
            where = name or "the root module"
            raise ConfigError(f"strategy=fsdp/hsdp: {where} ({type(child).__name__}) has parameters or buffers but no "
                              "reset_parameters(), so its values cannot be made after a meta build; valid: give the "
                              "model init_parameter(name, tensor) or each such module reset_parameters(), or "
                              "strategy=ddp")
    return "reset_parameters"


def _reset(child: nn.Module) -> None:
    if callable(getattr(child, "reset_parameters", None)) and (
            any(True for _ in child.parameters(recurse=False)) or any(True for _ in child.buffers(recurse=False))):
        child.reset_parameters()


def _children_first(module: nn.Module) -> Iterator[nn.Module]:
    """Every module once, children before their parent (``nn.Module.apply``'s order)."""
    for child in module.children():
        yield from _children_first(child)
    yield module


@contextlib.contextmanager
def _whole(child: nn.Module) -> Iterator[None]:
    """Within: ``child``'s own DTensor parameters are whole host tensors (one module's worth of memory); on exit
    each rank's rows of what the init wrote go into the shards, and the DTensors are put back (ties kept)."""
    swapped = {}
    for name, param in list(child._parameters.items()):
        if param is not None and hasattr(param, "device_mesh"):
            swapped[name] = param
            child._parameters[name] = nn.Parameter(_full_like(param), requires_grad=param.requires_grad)
    try:
        yield
    finally:
        for name, param in swapped.items():
            copy_full(param, child._parameters[name].detach())
            child._parameters[name] = param
