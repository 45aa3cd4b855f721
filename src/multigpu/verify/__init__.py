"""``mg.verify.record``: name a result so ``multigpu verify`` can compare it across world sizes (inside the ranks).

    import multigpu as mg

    out = mg.gather(my_part)                 # the whole result, on rank 0
    mg.verify.record("predictions", out)     # rank 0 writes it; other ranks do nothing
    mg.verify.record("loss", loss.item())    # numbers, tensors, arrays, nested lists

    shards = model(mg.shard(inputs))
    mg.verify.record("outputs", shards, gather=True)   # gathers along dim 0 first (a collective)

``multigpu verify --nproc 1,2,3 script.py`` gives each run a verify folder in its
run context (:mod:`multigpu.runtime.context`); without one ``record`` does
nothing, so the script runs unchanged.
Each result is saved as ``<name>.pt`` through a temporary file and a rename,
and read back with ``torch.load(weights_only=True)``: a result is made of
tensors, numbers, strings, lists, tuples and dicts, so reading a folder of
results runs no code from it. :mod:`multigpu.verify.compare` (pure) compares
the saved results.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from multigpu.files import atomic_path

__all__ = ["load_results", "record"]

_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_RECORDED: set[str] = set()


def _as_saved(value: Any) -> Any:
    """Tensors (moved to the CPU) as they are; numbers, arrays and lists of numbers as tensors; lists,
    tuples and dicts holding tensors item by item; anything else as is."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _as_saved(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and _holds_tensor_or_dict(value):
        return type(value)(_as_saved(item) for item in value)
    try:
        return torch.as_tensor(value).cpu()
    except (TypeError, ValueError, RuntimeError):
        return value  # strings, dicts: compared with ==


def _holds_tensor_or_dict(value: list | tuple) -> bool:
    import torch

    return any(isinstance(item, (torch.Tensor, dict))
               or (isinstance(item, (list, tuple)) and _holds_tensor_or_dict(item)) for item in value)


_PLAIN = (str, bytes, int, float, complex, bool, type(None))


def _check_plain(name: str, value: Any) -> None:
    """Refuse what ``load_results`` could not read back with weights_only (a custom object, say)."""
    import torch

    if isinstance(value, (torch.Tensor, *_PLAIN)):
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain(name, item)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(name, key)
            _check_plain(name, item)
        return
    raise ValueError(f"verify.record({name!r}) got a {type(value).__name__}; record tensors, numbers, arrays, "
                     "strings, or lists and dicts of them")


def record(name: str, value: Any, *, gather: bool = False) -> None:
    """Save a named result for ``multigpu verify``; rank 0 writes it.

    Args:
        name: Letters, digits, ``_ . -``; unique within the run.
        value: The whole result (a tensor, number, array or list), e.g. after ``mg.gather``.
            Values of other ranks are ignored unless ``gather`` is set.
        gather: ``value`` is this rank's shard: concatenate the shards along dim 0 in rank
            order first. Then this is a collective: call it on all ranks.

    Raises:
        ValueError: a bad or repeated name, or a value that is not made of tensors and plain values.
    """
    from multigpu.runtime import collectives, context, group

    if not _NAME.match(name):
        raise ValueError(f"verify.record name {name!r} is invalid; valid: letters, digits, _ . - (up to 128)")
    if name in _RECORDED:
        raise ValueError(f"verify.record({name!r}) was already called in this run; give each result its own name")
    _RECORDED.add(name)
    if gather:
        value = collectives.gather(value, dst=0)
    out_dir = context.current().verify_dir
    if not out_dir or group.rank() != 0:
        return
    import torch

    saved = _as_saved(value)
    _check_plain(name, saved)
    with atomic_path(Path(out_dir) / f"{name}.pt") as tmp:
        torch.save(saved, tmp)


def load_results(folder: str | Path) -> dict[str, Any]:
    """Every ``<name>.pt`` that ``record`` wrote into ``folder``, read with ``weights_only=True``.

    Raises:
        MultigpuError: one line naming a file that holds anything but tensors and plain values.
    """
    import pickle

    import torch

    from multigpu.errors import MultigpuError

    results = {}
    for path in sorted(Path(folder).glob("*.pt")):
        try:
            results[path.stem] = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise MultigpuError(f"verify result {path} holds something other than tensors and plain values; "
                                "it was not loaded (results are read with weights_only=True)") from None
    return results
