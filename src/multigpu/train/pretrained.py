"""Pretrained weights read straight into this rank's shards (inside each rank; names checked in the launcher).

    multigpu train --strategy fsdp --nproc-per-node 8 init_from=run/model.safetensors
    multigpu train --model multigpu.train.hf:causal_lm model.kwargs.config=ckpt/ init_from=ckpt/ --strategy fsdp

``init_from`` is a safetensors file, or a Hugging Face folder (``model.safetensors``,
or the shards listed by ``model.safetensors.index.json``). Each rank opens the files
lazily (``safe_open``) and reads, for every parameter, only the rows of its own
shard (``get_slice``): the file is memory-mapped, never loaded whole on one rank,
so a model larger than one rank's memory can start from its weights. Names are
the model's ``state_dict`` names; a name missing from the file is looked up under
the other names of the same (tied) tensor, as ``save_model`` stores a tied
tensor once. Values are cast to the parameter's dtype on copy.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from multigpu.errors import ConfigError

__all__ = ["check_weights", "load_weights", "weight_files"]


def weight_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it, for a file or a Hugging Face folder (headers only)."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: path / file for name, file in weight_map.items()}
        single = path / "model.safetensors"
        if not single.is_file():
            raise ConfigError(f"init_from={path}: the folder has neither model.safetensors nor "
                              "model.safetensors.index.json; valid: a safetensors file or a Hugging Face model folder")
        path = single
    if not path.is_file():
        raise ConfigError(f"init_from={path}: no such file or folder; valid: a .safetensors file or a Hugging Face "
                          "model folder")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: path for name in f.keys()}  # noqa: SIM118 - safe_open is not iterable
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own error types for a bad header
        raise ConfigError(f"init_from={path}: not a safetensors file ({str(exc).splitlines()[0]})") from None


def _names(module: nn.Module) -> Iterator[tuple[str, list[str], torch.Tensor]]:
    """(first name, every name of that tensor, tensor) for each parameter and persistent buffer, once."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), ([], param))[0].append(name)
    keys = set(module.state_dict(keep_vars=True))
    for name, buf in module.named_buffers(remove_duplicate=False):
        if name in keys:
            groups.setdefault(id(buf), ([], buf))[0].append(name)
    for names, tensor in groups.values():
        yield names[0], names, tensor


def _source(path: Path | str, files: dict[str, Path], names: list[str]) -> str:
    for name in names:
        if name in files:
            return name
    shown = ", ".join(sorted(files)[:6]) + (", ..." if len(files) > 6 else "")
    raise ConfigError(f"init_from={path}: no tensor named {' or '.join(map(repr, names))} for this model "
                      f"(the file has {len(files)}: {shown}); valid: weights saved from this model's architecture")


def check_weights(path: str | Path, module: nn.Module, shapes: bool = True) -> None:
    """Every parameter of ``module`` (a meta model will do) has a tensor in ``path``, of its shape unless
    ``shapes`` is False (headers only)."""
    from safetensors import safe_open

    files = weight_files(path)
    opened: dict[Path, object] = {}
    with contextlib.ExitStack() as stack:
        for first, names, tensor in _names(module):
            key = _source(path, files, names)
            handle = opened.get(files[key]) or opened.setdefault(
                files[key], stack.enter_context(safe_open(str(files[key]), framework="pt")))
            shape = tuple(handle.get_slice(key).get_shape())
            if shapes and shape != tuple(tensor.shape):
                raise ConfigError(f"init_from={path}: {key!r} has shape {list(shape)} but this model's {first!r} "
                                  f"has {list(tensor.shape)}; valid: weights of this exact model configuration")


@torch.no_grad()
def load_weights(module: nn.Module, path: str | Path) -> int:
    """Copy the weights at ``path`` into ``module``: this rank's rows of each sharded (DTensor) parameter, the whole
    of a plain one. Call on all ranks (no communication). Returns the bytes this rank read."""
    from safetensors import safe_open

    check_weights(path, module)  # one line for another model's weights, not a copy_ error midway
    files = weight_files(path)
    read = 0
    with contextlib.ExitStack() as stack:
        opened: dict[Path, object] = {}
        for _first, names, tensor in _names(module):
            key = _source(path, files, names)
            file = files[key]
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            rows = opened[file].get_slice(key)
            local, index = _local_index(tensor)
            part = rows[index] if index else opened[file].get_tensor(key)
            local.copy_(part)
            read += part.numel() * part.element_size()
    return read


def _local_index(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """(this rank's local tensor, the slice of the whole tensor it holds); None for a plain tensor (all of it)."""
    if not hasattr(tensor, "device_mesh"):
        return tensor, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.to_local(), tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
