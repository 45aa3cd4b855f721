"""This process's random state, captured and put back (inside each rank; checkpoints store it).

Python, NumPy, torch's CPU generator and the generator of this rank's *own* GPU
(the current CUDA device). Not every visible GPU's: a rank computes on one GPU,
and a job resumed with fewer visible GPUs (``--isolate-devices``, ``--gpus 4``,
a one-GPU machine) must still restore it, where a list of every visible GPU's
state cannot be put back (``torch.cuda.set_rng_state_all`` raises ``IndexError``).

Only tensors and plain values, so that ``torch.load(weights_only=True)`` reads
it back: NumPy's MT19937 key array is stored as an int64 tensor.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> dict[str, Any]:
    """This process's random state: Python, NumPy, torch CPU and (when CUDA is in use) the current GPU's."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached)
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Put back a state from :func:`capture_rng` (the GPU part into the current device, if this rank has one)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        if isinstance(keys, torch.Tensor):  # older checkpoints hold NumPy's own ndarray here, used as it is
            keys = keys.numpy()
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return  # saved without CUDA, or resumed on a CPU rank: the CPU generators are all there is
    device = torch.cuda.current_device()
    if isinstance(cuda, (list, tuple)):  # older checkpoints: every visible GPU's state; a rank used its own index
        if not cuda:
            return
        cuda = cuda[device % len(cuda)]
    torch.cuda.set_rng_state(cuda, device)
