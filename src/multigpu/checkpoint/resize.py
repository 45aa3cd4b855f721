"""A resume at another world size, recorded and checked: from N to M ranks, at which step, and whether the state
the ranks loaded equals the state that was saved (in the ranks).

A state's *fingerprint* is, per part, the float64 sum and sum of squares of every tensor in it, summed over the
job: a sharded tensor (a DTensor) counts each rank's shard once (its replicas divided out), a plain tensor is the
same on every rank and counts once. It does not depend on how the tensors are split, so the fingerprint written
with a checkpoint by N ranks and the one of the state M ranks loaded from it must agree: exactly where every
tensor is whole on every rank, within :data:`TOLERANCE` (relative) where sums over shards are added in another
order.

A workload whose state is rows of items that each have a global id (a simulation's agents, PPO's environments)
checks a *digest* instead: the sum over items of a 32-bit hash of each item's record (its id among its fields),
modulo 2**64, over the job. Integers added in any order give the same sum, so it is bit-exact whatever the split:
equal digests, equal items (up to hash collisions). :func:`digest_check` compares two.

Each resize is one JSON line in the run folder (:data:`multigpu.runtime.context.RESIZES_FILE`), written by rank 0; the run's
``summary.json`` lists them under ``resizes``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from multigpu.runtime.context import RESIZES_FILE, read_resizes

__all__ = ["TOLERANCE", "compare", "describe", "digest_check", "fingerprint",
           "record", "recorded", "records_digest", "resized_from", "row_digest"]

TOLERANCE = 1e-9
"""Relative difference allowed between two fingerprints (float64 sums added in another order)."""


def _tensors(value: Any):
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def fingerprint(parts: Mapping[str, Any]) -> dict[str, list[float]]:
    """{part: [sum, sum of squares]} of every tensor of each part (a state dict, or anything holding tensors),
    over the whole job. A collective: call on every rank, with the same parts."""
    import torch
    import torch.distributed as dist

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        DTensor = ()  # noqa: N806

    names = sorted(parts)
    whole = torch.zeros(2 * len(names), dtype=torch.float64)
    shards = torch.zeros(2 * len(names), dtype=torch.float64)
    for i, name in enumerate(names):
        for tensor in _tensors(parts[name]):
            if not (tensor.is_floating_point() or tensor.dtype in (torch.int32, torch.int64)):
                continue
            # on the tensor's own device, one float64 copy of one tensor at a time (no copy of the state to host)
            if isinstance(tensor, DTensor):
                replicas = math.prod(tensor.device_mesh.size(d) for d, p in enumerate(tensor.placements)
                                     if p.is_replicate())
                flat, into = tensor.to_local().detach().reshape(-1).double(), shards
            else:
                replicas, flat, into = 1, tensor.detach().reshape(-1).double(), whole
            into[2 * i] += float(flat.sum()) / replicas
            into[2 * i + 1] += float(flat.dot(flat)) / replicas
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and bool(shards.any()):
        from multigpu.runtime import group

        device = group.current_device()
        moved = shards.to(device)
        dist.all_reduce(moved)
        shards = moved.cpu()
    total = whole + shards
    return {name: [float(total[2 * i]), float(total[2 * i + 1])] for i, name in enumerate(names)}


def compare(saved: Mapping[str, list[float]], loaded: Mapping[str, list[float]]) -> dict[str, Any]:
    """{"equal", "max_rel_diff", "tolerance", "parts"}: does the loaded state's fingerprint match the saved one?"""
    worst = 0.0
    for name in set(saved) | set(loaded):
        a, b = saved.get(name), loaded.get(name)
        if a is None or b is None or len(a) != len(b):
            worst = math.inf
            continue
        for x, y in zip(a, b, strict=True):
            if not (math.isfinite(x) and math.isfinite(y)):  # a NaN sum shows nothing (NaN != NaN; max() drops it)
                worst = worst if x == y else math.inf
                continue
            scale = max(abs(x), abs(y), 1e-300)
            worst = max(worst, abs(x - y) / scale if x != y else 0.0)
    return {"equal": worst <= TOLERANCE, "bit_exact": worst == 0.0, "max_rel_diff": worst, "tolerance": TOLERANCE,
            "parts": sorted(set(saved) | set(loaded))}


def row_digest(rows: Mapping[str, Any]) -> int:
    """This rank's share of a digest (see the module docstring) of the items whose fields are ``rows`` (name ->
    a tensor whose first dimension is the item; give the items' global ids among them): the sum over items of
    a 32-bit hash of the item's bytes. Add the ranks' shares (an int64 all-reduce) for the job's."""
    import torch

    names = sorted(rows)
    if not names:
        return 0
    n = int(rows[names[0]].shape[0])
    if any(int(rows[k].shape[0]) != n for k in names):
        raise ValueError(f"row_digest(): the fields have different lengths ({ {k: int(rows[k].shape[0]) for k in names} })")
    if n == 0:
        return 0
    # each item's record: its fields' bytes side by side
    parts = [rows[k].detach().to("cpu").contiguous().reshape(n, -1).view(torch.uint8) for k in names]
    return records_digest(torch.cat(parts, dim=1))


def records_digest(records) -> int:
    """The sum over rows of a 32-bit hash (lowbias32 chained over its 32-bit lanes) of each row's bytes, ``records``
    a uint8 tensor ``[items, bytes]`` on any device, padded here to whole lanes. The one hash behind
    :func:`row_digest` and a simulation's state digest (``AgentState.digest_sum``)."""
    import torch

    n = int(records.shape[0])
    if n == 0:
        return 0
    pad = (-records.shape[1]) % 4
    if pad:
        records = torch.cat([records, records.new_zeros(n, pad)], dim=1)
    lanes = records.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    h = torch.full((n,), 0x2545F491, dtype=torch.int64, device=records.device)
    for j in range(lanes.shape[1]):
        h = _mix32(h ^ lanes[:, j] ^ (j + 1))
    return int(h.sum())


def _mix32(x):
    """lowbias32 (two multiply-xorshift rounds) on int64 tensors holding 32-bit values; products stay below 2**63."""
    for shift, multiplier in ((16, 0x7FEB352D), (15, 0x846CA68B - (1 << 32))):
        x = x ^ (x >> shift)
        x = (x * multiplier) & 0xFFFFFFFF
    return x ^ (x >> 16)


def digest_check(saved: str | None, loaded: str, parts: list[str]) -> dict[str, Any] | None:
    """The check of a resize for a digest (:func:`row_digest`, or a simulation's state digest): the same keys as
    :func:`compare`'s, and both digests. None where the checkpoint has no digest (written before they were)."""
    if not isinstance(saved, str):
        return None
    same = saved == loaded
    return {"equal": same, "bit_exact": same, "max_rel_diff": 0.0 if same else math.inf, "tolerance": 0.0,
            "parts": sorted(parts), "saved_digest": saved, "loaded_digest": loaded}


def describe(check: dict[str, Any] | None) -> str:
    """What a resize's check found, as the end of its line."""
    if check is None:
        return "the checkpoint has no fingerprint to check against (written before they were recorded)"
    if "saved_digest" in check:
        return ("the state loaded equals the saved one, bit for bit (digest "
                f"{check['loaded_digest']})" if check["equal"] else
                f"WARNING: the state loaded differs from the saved one (digest {check['loaded_digest']}, "
                f"saved {check['saved_digest']})")
    return (f"the state loaded equals the saved one (max relative difference {check['max_rel_diff']:.1e}, "
            f"tolerance {check['tolerance']:g})" if check["equal"] else
            f"WARNING: the state loaded differs from the saved one (max relative difference "
            f"{check['max_rel_diff']:.1e}, tolerance {check['tolerance']:g})")


def recorded(workload: str, run_dir: str | Path | None, *, from_ranks: int, to_ranks: int, step: int,
             checkpoint: str | Path, check: dict[str, Any] | None, unit: str = "step") -> str:
    """Record one resize (:func:`record`) and return its line, ``multigpu WORKLOAD: resized from N to M rank(s) at
    step S: <the check>``, for the caller to print. Rank 0 calls it, after every rank took part in the check."""
    record(run_dir, {"from_ranks": from_ranks, "to_ranks": to_ranks, "step": step, "checkpoint": str(checkpoint),
                     "check": check})
    return (f"multigpu {workload}: resized from {from_ranks} to {to_ranks} rank(s) at {unit} {step}: "
            f"{describe(check)}")


def record(run_dir: str | Path | None, entry: dict[str, Any]) -> None:
    """Append one resize to the run folder's resize records (rank 0 calls it); a full disk loses only it."""
    if run_dir is None:
        return
    entry = {**entry, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with contextlib.suppress(OSError):
        fd = os.open(Path(run_dir) / RESIZES_FILE, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\n")


def resized_from(run_dir: str | Path | None, saved_world: int, world: int) -> int | None:
    """The world size a resume at ``world`` ranks is resized from, or None where it is no resize.

    A checkpoint written by ``saved_world`` != ``world`` ranks: from ``saved_world``. A checkpoint of this very size:
    a resize all the same where the run last ran at another size from it, its last resize's ``to_ranks`` (an
    elastic job that lost a node and got it back before the smaller group wrote a checkpoint re-formed at 2 ranks
    from the 2-rank checkpoint the 1-rank group had loaded: 2 -> 1 was recorded, 1 -> 2 was not). Every rank reads
    the same run folder."""
    if saved_world != world:
        return saved_world
    records = read_resizes(run_dir) if run_dir is not None else []
    last = records[-1].get("to_ranks") if records else None
    return last if isinstance(last, int) and last > 0 and last != world else None
