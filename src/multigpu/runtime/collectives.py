"""Collectives with timeouts, shape checks and order-preserving gather (inside each rank).

Every function here but ``send``/``recv`` (one sender, one receiver) must be called on all ranks. With ``world_size == 1`` each
one is the identity (no process group exists; the test harness's group of one has one and takes the multi-rank
path). Checked collectives compare shapes and dtypes over gloo first (the host group beside NCCL), so a
mismatch raises on every rank before any data moves, and the check never waits for a GPU. Errors from torch are rewritten
into :class:`~multigpu.errors.CollectiveTimeoutError` (naming this rank, the
call and the timeout) or :class:`~multigpu.errors.ShapeMismatchError`
(listing every rank's shape) instead of hanging or printing gloo's internals.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from multigpu.errors import CollectiveError, ShapeMismatchError
from multigpu.runtime import calls, group
from multigpu.runtime.calls import collective_seconds, comm_between, comm_mark

__all__ = [
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "broadcast_object",
    "collective_seconds",
    "comm_between",
    "comm_mark",
    "record_traffic",
    "gather",
    "isend",
    "recv",
    "send",
    "timed_collective",
    "traffic",
]

_MAX_DIMS = 8
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]
_TRAFFIC: dict[str, list[int]] = {}  # kind -> [calls, bytes this rank put in] (read by StepMeter, bench --predict)

TRAFFIC_KINDS = ("all_reduce", "all_gather", "sharded_all_gather", "gather", "broadcast", "reduce_scatter",
                 "all_to_all", "p2p")
"""What :func:`record_traffic` counts: the collective patterns ``multigpu bench --predict`` has a cost formula for."""


TRAFFIC_GROUPS = ("shard", "replicate")
"""The groups of a 2-D ``(replicate, shard)`` mesh (HSDP) a collective may run over instead of every rank."""


def record_traffic(kind: str, nbytes: int, calls: int = 1, group: str | None = None) -> None:
    """Count one collective (or ``calls``) of ``kind`` into which this rank put ``nbytes`` bytes: the tensor of an
    all-reduce or broadcast, this rank's part of an all-gather or gather, what it sends in an all-to-all or a send;
    for ``reduce_scatter`` and ``sharded_all_gather`` (FSDP's), the whole tensor reduced or gathered.

    ``group``: over every rank (None), or over one group of HSDP's mesh (counted as ``kind:group``): ``shard``, the
    ranks of a replica; ``replicate``, the ranks holding the same shard, for which ``nbytes`` is the whole tensor
    of which each rank reduces its shard (1 / the shard group's size).

    Workloads that call ``torch.distributed`` directly (DDP's hooks, the simulation's exchanges) count here too, so
    the figures are the job's own collectives, not an estimate."""
    if group is not None:
        if group not in TRAFFIC_GROUPS:
            raise ValueError(f"no collective group {group!r}; valid: {', '.join(TRAFFIC_GROUPS)}")
        kind = f"{kind}:{group}"
    entry = _TRAFFIC.setdefault(kind, [0, 0])
    entry[0] += calls
    entry[1] += int(nbytes)


def traffic() -> dict[str, tuple[int, int]]:
    """``{kind: (calls, bytes)}`` this rank has counted since it started (see :func:`record_traffic`)."""
    return {k: (v[0], v[1]) for k, v in _TRAFFIC.items()}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _active() -> bool:
    """Whether a process group exists: world_size > 1, or the test harness's group of one."""
    return group.is_initialized() and group.get_env().backend != "none"


@contextlib.contextmanager
def timed_collective(op: str, device: torch.device | None = None) -> Iterator[None]:
    """Time the collective called in the block and rewrite torch's errors into ours, naming rank and call
    (:func:`calls.timed`). Every function here runs its torch call in one; so does code that calls torch's own
    collectives directly (the simulation's halo, migration and network exchanges). Call on all ranks.

    ``device``: the tensor's device; on CUDA the collective is timed on the device (see collective_seconds).
    """
    env = group.get_env(op)
    with calls.timed(op, env.rank, env.world_size, group.timeout_s(), device):
        yield


def barrier() -> None:
    """Wait until every rank reaches this point. Call on all ranks.

    On gloo this is ``monitored_barrier``: when a rank does not arrive within the
    timeout, rank 0's error names the missing ranks.
    """
    if not _active():
        group.get_env("barrier")
        return
    env = group.get_env("barrier")
    calls.barrier(env.rank, env.world_size, group.timeout_s(), monitor=group.monitor_group(),
                  monitored=env.backend == "gloo")


def _meta(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > _MAX_DIMS:
        raise CollectiveError(f"collectives support tensors of at most {_MAX_DIMS} dims, got {tensor.dim()}")
    shape = list(tensor.shape) + [-1] * (_MAX_DIMS - tensor.dim())
    code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else -2
    return torch.tensor([tensor.dim(), code, *shape], dtype=torch.int64)


def _all_metas(tensor: torch.Tensor, op: str) -> list[tuple[tuple[int, ...], torch.dtype | None]]:
    """Every rank's (shape, dtype), exchanged as CPU tensors over gloo (the host group beside NCCL).

    Never over NCCL: reading an NCCL result on the host waits for every kernel queued before it (a full
    device sync per checked collective, every step). Over gloo only the host waits, for the other ranks
    to reach the same call (or the group's timeout), and the data collective is queued after the check.
    """
    mine = _meta(tensor)
    parts = [torch.empty_like(mine) for _ in range(group.get_env().world_size)]
    record_traffic("all_gather", _nbytes(mine))
    with timed_collective(op):
        dist.all_gather(parts, mine, group=group.host_group())
    out = []
    for p in parts:
        p = p.tolist()
        ndim, code = p[0], p[1]
        out.append((tuple(p[2 : 2 + ndim]), _DTYPES[code] if code >= 0 else None))
    return out


def _check_shapes(tensor: torch.Tensor, op: str, *, allow_dim0: bool) -> list[tuple[int, ...]]:
    metas = _all_metas(tensor, op)
    shapes = [s for s, _ in metas]
    dtypes = {d for _, d in metas}
    if allow_dim0:
        ok = all(len(s) == len(shapes[0]) and len(s) > 0 and s[1:] == shapes[0][1:] for s in shapes)
        rule = "equal shapes except dim 0 (and at least 1 dim)"
    else:
        ok = all(s == shapes[0] for s in shapes)
        rule = "the same shape on every rank"
    if not ok:
        raise ShapeMismatchError(op, shapes, rule)
    if len(dtypes) != 1:
        raise ShapeMismatchError(op, [f"{s} {d}" for s, d in metas], "the same dtype on every rank")
    return shapes


def _gather_tensor(tensor: torch.Tensor, dst: int | None) -> torch.Tensor | None:
    env = group.get_env()
    shapes = _check_shapes(tensor, "gather", allow_dim0=True)
    longest = max(s[0] for s in shapes)
    padded = tensor
    if tensor.shape[0] < longest:
        filler = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, filler])
    padded = padded.contiguous()
    receive = dst is None or env.rank == dst
    buffers = [torch.empty_like(padded) for _ in shapes] if receive else None
    record_traffic("all_gather" if dst is None else "gather", _nbytes(padded))
    with timed_collective("gather", padded.device):
        if dst is None:
            dist.all_gather(buffers, padded)
        else:
            dist.gather(padded, gather_list=buffers, dst=dst)
    if not receive:
        return None
    return torch.cat([b[: s[0]] for b, s in zip(buffers, shapes, strict=True)])


def _concat_objects(parts: Sequence[Any]) -> Any:
    if all(isinstance(p, (list, tuple)) for p in parts):
        return [x for p in parts for x in p]
    return list(parts)


def gather(obj: Any, *, dst: int | None = 0) -> Any:
    """Collect every rank's part on ``dst``, concatenated in rank order. Call on all ranks.

    Parts made by :func:`shard` come back in the original item order.

    Args:
        obj: A tensor (concatenated along dim 0; dim 0 may differ between
            ranks, the other dims and the dtype may not) or a Python object
            (lists and tuples are concatenated into one list; any other object
            comes back as a list with one entry per rank).
        dst: The rank that receives the result; others get ``None``.
            ``None``: every rank receives it.

    Raises:
        ShapeMismatchError: tensors differ beyond dim 0; every rank's shape is listed.

    Example (world_size=2)::

        mine = mg.shard(["a", "b", "c"])   # rank 0 -> ["a", "b"]; rank 1 -> ["c"]
        mg.gather([s.upper() for s in mine])
        # rank 0 -> ["A", "B", "C"]; rank 1 -> None
    """
    if not _active():
        group.get_env("gather")
        return obj if isinstance(obj, torch.Tensor) else _concat_objects([obj])
    if isinstance(obj, torch.Tensor):
        return _gather_tensor(obj, dst)
    env = group.get_env()
    with timed_collective("gather"):
        if dst is None:
            parts: list[Any] = [None] * env.world_size
            dist.all_gather_object(parts, obj)
        else:
            parts = [None] * env.world_size if env.rank == dst else None
            dist.gather_object(obj, parts, dst=dst)
    return None if parts is None else _concat_objects(parts)


def all_gather(obj: Any) -> Any:
    """``gather(obj, dst=None)``: every rank receives the concatenation. Call on all ranks."""
    return gather(obj, dst=None)


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "mean": dist.ReduceOp.SUM}


def all_reduce(tensor: torch.Tensor, op: str = "sum", *, check_shapes: bool = True) -> torch.Tensor:
    """Reduce ``tensor`` in place across ranks (``"sum"``, ``"mean"``, ``"max"``, ``"min"``) and return it.

    Call on all ranks. ``check_shapes`` first compares every rank's shape (one
    small extra collective) so a mismatch raises ``ShapeMismatchError`` instead
    of hanging; pass False on hot paths whose shapes are fixed by construction.
    """
    if op not in _OPS:
        raise ValueError(f"op={op!r} is not one of {', '.join(_OPS)}")
    if not _active():
        group.get_env("all_reduce")
        return tensor
    if check_shapes:
        _check_shapes(tensor, "all_reduce", allow_dim0=False)
    record_traffic("all_reduce", _nbytes(tensor))
    with timed_collective("all_reduce", tensor.device):
        dist.all_reduce(tensor, op=_OPS[op])
    if op == "mean":
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.div_(group.get_env().world_size)
        else:
            tensor.floor_divide_(group.get_env().world_size)
    return tensor


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with ``src``'s, in place, and return it. Call on all ranks."""
    if not _active():
        group.get_env("broadcast")
        return tensor
    _check_shapes(tensor, "broadcast", allow_dim0=False)
    record_traffic("broadcast", _nbytes(tensor))
    with timed_collective("broadcast", tensor.device):
        dist.broadcast(tensor, src=src)
    return tensor


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Return ``src``'s Python object on every rank (pickled). Call on all ranks."""
    if not _active():
        group.get_env("broadcast_object")
        return obj
    box = [obj]
    with timed_collective("broadcast_object"):
        dist.broadcast_object_list(box, src=src)
    return box[0]


class Pending:
    """A send under way (:func:`isend`): ``wait()`` returns once the receiver has it, or raises at the timeout."""

    def __init__(self, works: list, keep: list[torch.Tensor]):
        self._works, self._keep = works, keep  # the tensors stay alive until the transport is done with them

    def wait(self) -> None:
        limit = timedelta(seconds=group.timeout_s())
        with timed_collective("send"):
            for work in self._works:
                work.wait(limit)
        self._works, self._keep = [], []


def _route(pg, peer: int, *, sending: bool) -> tuple[Any, int]:
    """``(process group or None, peer's rank in it)``; a :class:`~multigpu.runtime.group.Loopback` picks its end."""
    if isinstance(pg, group.Loopback):
        return pg.route(peer, sending=sending)
    return pg, peer  # the default group, or one of every rank: group ranks are global ranks


def isend(tensor: torch.Tensor, dst: int, *, tag: int = 0, pg=None) -> Pending:
    """Start sending ``tensor`` (any shape and dtype) to rank ``dst``, which calls ``recv(src=<this rank>)``.

    Point to point: only the two ranks take part. A small header (shape, dtype)
    goes first, so the receiver needs to know nothing in advance. Returns at
    once; call ``wait()`` on the result before the process leaves the group
    (messages to one receiver arrive in the order sent). CPU tensors only on
    gloo; on nccl the tensor is moved to this rank's device. ``pg``: another
    group, e.g. :func:`~multigpu.runtime.group.exchange_group` (gloo: the tensor
    travels from the CPU, and the receiver passes the same ``pg``).
    """
    env = group.get_env("send")
    if pg is None and env.backend == "nccl":
        tensor = tensor.to(group.device())
    elif pg is not None:
        tensor = tensor.cpu()
    header, data = _meta(tensor).to(tensor.device), tensor.contiguous()
    pg, peer = _route(pg, dst, sending=True)
    record_traffic("p2p", _nbytes(header) + _nbytes(data), calls=2 if data.numel() else 1)
    with timed_collective("send"):
        works = [dist.isend(header, group=pg, group_dst=peer, tag=tag)]
        if data.numel():
            works.append(dist.isend(data, group=pg, group_dst=peer, tag=tag))
    return Pending(works, [header, data])


def send(tensor: torch.Tensor, dst: int, *, tag: int = 0, pg=None) -> None:
    """:func:`isend` and wait: returns once rank ``dst`` has received ``tensor``; the group's timeout applies."""
    isend(tensor, dst, tag=tag, pg=pg).wait()


def recv(src: int, *, tag: int = 0, pg=None) -> torch.Tensor:
    """Receive the tensor that rank ``src`` sends with ``send(..., dst=<this rank>)`` (the same ``pg``); returned
    on the CPU. Over gloo (any ``pg``, or a gloo job) only this thread waits for the sender, never a CUDA stream."""
    env = group.get_env("recv")
    device = group.device() if pg is None and env.backend == "nccl" else torch.device("cpu")
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    limit = timedelta(seconds=group.timeout_s())
    pg, peer = _route(pg, src, sending=False)
    with timed_collective("recv"):
        dist.irecv(header, group=pg, group_src=peer, tag=tag).wait(limit)
        fields = header.cpu().tolist()
        ndim, code = fields[0], fields[1]
        if code < 0:
            raise CollectiveError(f"recv() from rank {src}: the sender's dtype is not one of {_DTYPES}")
        out = torch.empty(fields[2:2 + ndim], dtype=_DTYPES[code], device=device)
        if out.numel():
            dist.irecv(out, group=pg, group_src=peer, tag=tag).wait(limit)
    return out.cpu()
