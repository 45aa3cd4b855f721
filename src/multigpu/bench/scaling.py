"""What strong and weak scaling mean for a workload's config at each world size (runs in the launcher).

* strong: the global problem stays the one of the smallest world size benched (the baseline);
* weak: each rank's share stays the baseline's, so the global problem grows with the world size.

Most workloads size their problem globally (sim's agents, infer's images, rl's and envs' environments) and
apply weak scaling themselves, in each rank, through the run context's ``problem_scale``: their config is
the same at every world size. A config that sets its batch per rank (train's ``batch_size``, the
:class:`~multigpu.train.config.TrainConfig` protocol: ``effective_batch(world_size)`` and
``global_batch_size``) would double its global batch at 2 ranks under either label; :func:`configs_per_size`
pins its global batch here, per world size: the baseline's under strong, the baseline's per-rank share times
the world size under weak. Its steps stay the same, so the global work per step is what the label says.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from multigpu.errors import ConfigError

__all__ = ["configs_per_size", "global_batch"]


def global_batch(cfg: Any, world_size: int) -> int | None:
    """Samples per optimizer step over the whole job, for a config that has a batch per rank; else None."""
    effective = getattr(cfg, "effective_batch", None)
    return effective(world_size) if callable(effective) and hasattr(cfg, "global_batch_size") else None


def configs_per_size(cfg: Any, scaling: str, sizes: list[int]) -> dict[int, Any]:
    """The config of each world size, with its global batch pinned as ``scaling`` says (see the module).

    Raises:
        ConfigError: the global batch does not split evenly over a world size, naming it and what would.
    """
    base = min(sizes)
    batch = global_batch(cfg, base)
    if batch is None:
        return {n: cfg for n in sizes}
    out = {}
    for n in sizes:
        want = batch if scaling == "strong" else batch // base * n
        if global_batch(cfg, n) == want:
            out[n] = cfg
            continue
        pinned = dataclasses.replace(cfg, global_batch_size=want)
        try:
            pinned.validate_for(n)
        except ConfigError as exc:
            what = (f"keeps the global batch at {want} (the one of {base} rank(s)) at every world size"
                    if scaling == "strong" else f"keeps {batch // base} samples per rank ({want} at {n} ranks)")
            raise ConfigError(f"{scaling} scaling {what}, but at {n} ranks: {exc}; valid: world sizes that "
                              "divide it, or another batch_size or global_batch_size") from None
        out[n] = pinned
    return out
