"""Checkpoints of the sharded agent state with ``torch.distributed.checkpoint`` (inside each rank).

The agents are saved as one global tensor per field, ordered by agent id, so
a run saved on P ranks resumes on any number of ranks (and any strategy) with
the same result. Before saving, each rank's agents are sent to the rank that
owns their id range in torch.chunk layout (``ceil(N / P)`` ids per rank), sorted,
and wrapped as a ``Shard(0)`` DTensor; loading reads the ranges of the new layout.

Layout of one checkpoint (written to ``<name>.tmp`` and renamed once complete)::

    checkpoints/step_000050/
        .metadata, __0_0.distcp, ...     # torch.distributed.checkpoint
        engine.json                      # step, global scalars, aggregates so far, partition,
                                         # and the size and SHA-256 of .metadata

DCP's ``.metadata`` is a pickle, and torch's reader unpickles it with
``pickle.load``: a crafted one runs code. So nothing here lets torch read it
(:mod:`multigpu.dcp_safe`, shared with the trainer's sharded checkpoints):

* ``engine.json`` records its size and SHA-256; a checkpoint whose ``.metadata``
  does not match (or that records none) is refused by name before it is opened
  (``--resume DIR`` in the launcher, which reads bytes only), or skipped with a
  warning by ``resume=auto``;
* the ranks read ``.metadata`` themselves with an unpickler that builds only
  DCP's own metadata classes, ``torch.Size``, dtypes and paths, and refuses any
  other global (a function call, a class from elsewhere) with one line naming it;
  torch's reader is handed that result and never unpickles the file itself,
  nor a rank-local ``__<rank>.metadata``;
* the tensor files are read by torch with ``weights_only=True``, and byte
  entries (which torch would load with ``weights_only=False``) are refused.

The checksum shows that a checkpoint is the one a known run wrote; it cannot
show who wrote a folder someone hands you, since they can write engine.json
too. Resume a simulation only from a checkpoint from a trusted source.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from multigpu import dcp_safe
from multigpu.checkpointing import CorruptCheckpointError, sha256_file
from multigpu.errors import ConfigError
from multigpu.monitor import write_json_atomic
from multigpu.runtime import collectives, group
from multigpu.runtime.logging import get_logger
from multigpu.sim import exchange
from multigpu.sim.engine import SimEngine
from multigpu.sim.state import AgentState

__all__ = ["check_checkpoint", "latest", "load", "save"]

_PREFIX = "step_"
_METADATA = dcp_safe.METADATA


def _world() -> tuple[int, int]:
    if group.is_initialized() and group.world_size() > 1:
        return group.rank(), group.world_size()
    return 0, 1


def _id_range(n: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def _wrap(local: torch.Tensor, n: int):
    """This rank's id-range slice as a Shard(0) DTensor of global length n (plain tensor on one rank)."""
    _, world = _world()
    if world == 1:
        return local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(local.device.type, (world,))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([n]), stride=(1,))


def save(engine: SimEngine, directory: str | Path) -> Path:
    """Save ``engine`` to ``directory`` (atomically: a ``.tmp`` folder renamed at the end). Call on all ranks."""
    directory = Path(directory)
    rank, world = _world()
    tmp = directory.with_name(directory.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    engine.flush()
    n = engine.num_agents
    # a copy of this rank's agents, sent to the owner of their id range, sorted by id
    copy = AgentState(engine.state.schema, engine.state.n, engine.device)
    copy.append({k: engine.state[k] for k in copy.schema})
    if world > 1:
        per = -(-n // world)
        dest = (copy["id"].to(torch.int64) // per).to(torch.int32)
        away = torch.nonzero(dest != rank).reshape(-1)
        exchange.migrate(copy, away, dest[away])
    fields = copy.sorted_by_id()
    lo, hi = _id_range(n, rank, world)
    if fields["id"].numel() != hi - lo:
        raise RuntimeError(f"checkpoint: rank {rank} holds {fields['id'].numel()} agents, expected {hi - lo}")
    state = {f"agents.{k}": _wrap(v, n) for k, v in fields.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(tmp))
    if rank == 0:
        size, digest = sha256_file(tmp / _METADATA)  # DCP wrote it on rank 0, the coordinator
        write_json_atomic(tmp / "engine.json", {**_engine_meta(engine),
                                                "checksums": {_METADATA: {"bytes": size, "sha256": digest}}})
    _barrier()
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    _barrier()
    return directory


def _engine_meta(engine: SimEngine) -> dict:
    env = {k: v for k, v in engine.ctx.env.items() if not k.startswith("_") and k != "series"}
    return {
        "step": engine.step_index,
        "num_agents": engine.num_agents,
        "model": engine.cfg.model,
        "seed": engine.cfg.seed,
        "grid": list(engine.cfg.grid),
        "params": dict(engine.cfg.params),
        "env": env,
        "history": engine.history,
        "rebalances": engine.rebalances,
        "world_size": _world()[1],
    }


def _barrier() -> None:
    if _world()[1] > 1:
        collectives.barrier()


def check_checkpoint(directory: str | Path) -> dict[str, Any]:
    """``directory``'s engine.json, once its ``.metadata`` has the size and SHA-256 recorded there.

    Reads bytes only (nothing is unpickled), so the launcher can call it. Local; no communication.

    Raises:
        CorruptCheckpointError: naming the folder and what is wrong (no engine.json, no checksum
            recorded, .metadata missing, truncated or altered).
    """
    directory = Path(directory)
    try:
        meta = json.loads((directory / "engine.json").read_text())
        entry = meta.get("checksums", {}).get(_METADATA) if isinstance(meta, dict) else None
    except FileNotFoundError:
        raise CorruptCheckpointError(directory, "it is not a checkpoint folder (no engine.json)") from None
    except (OSError, ValueError, AttributeError) as exc:
        raise CorruptCheckpointError(directory, f"its engine.json cannot be read ({type(exc).__name__})") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) or not isinstance(entry.get("sha256"), str):
        raise CorruptCheckpointError(directory, f"its engine.json records no SHA-256 of {_METADATA}, so {_METADATA} "
                                                "(a pickle) cannot be verified and is not loaded")
    path = directory / _METADATA
    if not path.is_file():
        raise CorruptCheckpointError(directory, f"it has no {_METADATA}")
    size, digest = sha256_file(path)
    if (size, digest) != (entry["bytes"], entry["sha256"]):
        raise CorruptCheckpointError(directory, f"{_METADATA} does not match engine.json ({size:,} bytes, SHA-256 "
                                                f"{digest[:16]}… on disk; {entry['bytes']:,} bytes, "
                                                f"{entry['sha256'][:16]}… written): it was altered or damaged")
    return meta


def load(engine: SimEngine, directory: str | Path) -> None:
    """Fill an engine created with ``populate=False`` from ``directory``. Call on all ranks.

    ``.metadata`` is verified against engine.json's checksum and read by a restricted unpickler
    before torch sees the folder (see the module docstring).

    Raises:
        CorruptCheckpointError: the checkpoint fails its checksum, or holds more than tensors.
        ConfigError: the checkpoint was written by a different model, seed, grid, agent count or parameters.
    """
    directory = Path(directory)
    meta = check_checkpoint(directory)
    metadata = dcp_safe.read_metadata(directory)
    _check_compatible(engine, meta, directory)
    rank, world = _world()
    n = engine.num_agents
    lo, hi = _id_range(n, rank, world)
    locals_ = {k: torch.empty(hi - lo, dtype=dt, device=engine.device) for k, dt in engine.state.schema.items()}
    state = {f"agents.{k}": _wrap(v, n) for k, v in locals_.items()}
    dcp_safe.load(state, directory, metadata)
    loaded = {k: (state[f"agents.{k}"].to_local() if world > 1 else state[f"agents.{k}"]) for k in locals_}
    engine.state.append(loaded)
    if engine.spatial:
        engine._send_strays(0)
    if engine.uses_network:
        engine.arrange_by_id()
    elif engine.model.spatial and engine.cfg.sort_every:
        engine.sort_by_row()
    engine.step_index = meta["step"]
    engine.ctx.env.update(meta["env"])
    engine.history = {k: list(v) for k, v in meta["history"].items()}
    engine.rebalances = list(meta["rebalances"])
    if dist.is_initialized() and world > 1:
        collectives.barrier()


def _check_compatible(engine: SimEngine, meta: dict, directory: Path) -> None:
    mine = {"model": engine.cfg.model, "seed": engine.cfg.seed, "grid": list(engine.cfg.grid),
            "num_agents": engine.num_agents, "params": dict(engine.cfg.params)}
    for key, value in mine.items():
        if meta[key] != value:
            raise ConfigError(f"checkpoint {directory} has {key}={meta[key]!r} but this run has {value!r}; "
                              "resume with the same settings or start a new run directory")


def latest(root: str | Path) -> Path | None:
    """The newest complete, verified checkpoint under ``root`` (``step_*`` folders), or None.

    A folder without engine.json (a save in progress) is passed over silently; one whose
    ``.metadata`` fails :func:`check_checkpoint` is skipped with a warning on rank 0.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    done = [p for p in root.glob(f"{_PREFIX}*")
            if p.is_dir() and p.name[len(_PREFIX):].isdigit() and (p / "engine.json").is_file()]
    for path in sorted(done, key=lambda p: int(p.name[len(_PREFIX):]), reverse=True):
        try:
            check_checkpoint(path)
            return path
        except CorruptCheckpointError as exc:
            if _world()[0] == 0:
                get_logger().warning(f"skipping {exc}")
    return None


def path_for(root: str | Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:06d}"
