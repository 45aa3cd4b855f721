"""Checkpoints of the sharded agent state, in the one checkpoint store (inside each rank).

The agents are saved as one global tensor per field, ordered by agent id, so
a run saved on P ranks resumes on any number of ranks (and any strategy) with
the same result. Before saving, each rank's agents are sent to the rank that
owns their id range in torch.chunk layout (``ceil(N / P)`` ids per rank), sorted,
and wrapped as a ``Shard(0)`` DTensor; loading reads the ranges of the new layout.

A checkpoint is a ``step_*`` folder of :class:`multigpu.checkpoint.CheckpointStore`:
the agents as a sharded part (DCP), the aggregates so far (the series a resumed run continues), the model's global
values and the rebalances as a plain part (``state.pt``: checksummed like every file), and the engine's step and
settings in the manifest's ``meta`` (read before anything
is unpickled: a checkpoint of another model, seed, grid, agent count or
parameters is refused in one line). The meta holds the agents' state digest too (split-independent:
:func:`state_digest`), which a resume at another world size checks the re-partitioned agents against
(:func:`check_resize`). The store checks every file's size and
SHA-256 and reads DCP's ``.metadata`` with a restricted unpickler
(:mod:`multigpu.checkpoint.dcp_safe`). The checksums show that a checkpoint is the one a
known run wrote, not who wrote the folder: resume a simulation only from a
checkpoint from a trusted source.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from multigpu.checkpoint import CheckpointStore, Sharded, verify
from multigpu.errors import ConfigError
from multigpu.runtime import collectives, group
from multigpu.sim.engine import SimEngine
from multigpu.sim.population import agents_by_id, id_range

__all__ = ["EngineAgents", "EngineRecord", "check_resize", "load", "meta", "parts", "save", "state_digest"]


def _world() -> tuple[int, int]:
    if group.is_initialized() and group.world_size() > 1:
        return group.rank(), group.world_size()
    return 0, 1


def _wrap(local: torch.Tensor, n: int):
    """This rank's id-range slice as a Shard(0) DTensor of global length n (plain tensor on one rank)."""
    _, world = _world()
    if world == 1:
        return local
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh(local.device.type, (world,))
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size([n]), stride=(1,))


class _Agents:
    """The agents as a checkpoint part: ``agents.<field>`` -> this rank's id range, wrapped as a global tensor."""

    def __init__(self, fields: dict[str, torch.Tensor], n: int):
        self.fields = {f"{k}": _wrap(v, n) for k, v in fields.items()}

    def state_dict(self) -> dict:
        return dict(self.fields)

    def load_state_dict(self, state: dict) -> None:
        self.fields = dict(state)


class EngineAgents:
    """A running engine's agents as a checkpoint part (``Sharded``): taken at each save, sent to the owner of
    their id range and sorted by id (a collective: every rank saves at the same step). ``engine``: the engine
    itself (what a callback's ``event.state["agents"]`` reaches)."""

    def __init__(self, engine: SimEngine):
        self.engine = engine

    def state_dict(self) -> dict:
        self.engine.flush()
        fields, _, _ = agents_by_id(self.engine)  # a copy, each agent on the owner of its id range, by id
        return _Agents(fields, self.engine.num_agents).state_dict()


class EngineRecord:
    """What the engine has recorded so far, as a plain checkpoint part (``state.pt``, whose size and SHA-256 the
    manifest records): every step's aggregates (the series a resumed run continues), the model's global values and
    the rebalances. Rank 0's copy is saved (every rank holds the same)."""

    def __init__(self, engine: SimEngine):
        self.engine = engine

    def state_dict(self) -> dict:  # rank 0 only, after the agents' part has flushed the aggregates on every rank
        return {"history": {k: list(v) for k, v in self.engine.history.items()}, "env": _env(self.engine),
                "rebalances": list(self.engine.rebalances)}

    def load_state_dict(self, state: dict) -> None:
        _restore_record(self.engine, state)


def _env(engine: SimEngine) -> dict:
    return {k: v for k, v in engine.ctx.env.items() if not k.startswith("_") and k != "series"}


def _restore_record(engine: SimEngine, record: dict) -> None:
    engine.ctx.env.update(record["env"])
    engine.history = {k: list(v) for k, v in record["history"].items()}
    engine.rebalances = list(record["rebalances"])


def parts(engine: SimEngine) -> dict:
    """The checkpoint parts of ``engine``: its agents (sharded by id range) and what it has recorded so far (the
    series: checksummed with the rest); :func:`meta` is what the launcher checks before reading a file."""
    return {"agents": Sharded(EngineAgents(engine)), "record": EngineRecord(engine)}


def save(engine: SimEngine, store: CheckpointStore) -> Path:
    """Save ``engine`` as checkpoint ``engine.step_index`` of ``store`` (atomically). Call on all ranks."""
    return store.save(engine.step_index, parts(engine), meta=meta(engine))


def meta(engine: SimEngine) -> dict:
    """The engine's step, global scalars, aggregates so far and settings, for the manifest (plain JSON). Call on
    all ranks (the aggregates still travelling are summed first)."""
    engine.flush()
    return _engine_meta(engine)


def state_digest(engine: SimEngine) -> str:
    """A digest of every agent's state in the job, ``<hash sum>-<agents>``, that does not depend on how the agents
    are split or ordered: equal digests, equal agents (:meth:`AgentState.digest_sum`). A collective."""
    digest = torch.tensor([engine.state.digest_sum(), engine.state.n], dtype=torch.int64)
    if group.is_initialized() and group.world_size() > 1:
        collectives.all_reduce(digest, "sum", check_shapes=False)
    return f"{int(digest[0]) & (2**64 - 1):016x}-{int(digest[1])}"


def _engine_meta(engine: SimEngine) -> dict:
    return {
        "step": engine.step_index,
        "num_agents": engine.num_agents,
        "model": engine.cfg.model,
        "seed": engine.cfg.seed,
        "grid": list(engine.cfg.grid),
        "params": dict(engine.cfg.params),
        "world_size": _world()[1],
        "state_digest": state_digest(engine),  # what a resume at another world size checks its agents against
    }


def load(engine: SimEngine, run) -> dict:
    """Fill an engine created with ``populate=False`` from the checkpoint ``run`` resumes from
    (:attr:`multigpu.run.Run.resume_from`; the run reads the files: :meth:`multigpu.run.Run.load`, the one
    loading path of every workload). Call on all ranks. Returns the checkpoint's meta (:func:`meta`).

    Raises:
        CorruptCheckpointError: the checkpoint fails its checksums, or holds more than tensors.
        ConfigError: the checkpoint was written by a different model, seed, grid, agent count or parameters.
    """
    from multigpu.checkpoint import dcp_safe

    directory = Path(run.resume_from)
    meta = verify(directory, only=(".metadata",))["meta"]
    dcp_safe.read_metadata(directory)  # a crafted .metadata is refused before anything else is said about it
    _check_compatible(engine, meta, directory)
    rank, world = _world()
    n = engine.num_agents
    lo, hi = id_range(n, rank, world)
    part = _Agents({k: torch.empty(hi - lo, dtype=dt, device=engine.device)
                    for k, dt in engine.state.schema.items()}, n)
    # the record is in state.pt (checksummed); a checkpoint written before kept it in the manifest's meta
    record = {"history": meta["history"], "env": meta["env"], "rebalances": meta["rebalances"]} \
        if "history" in meta else None
    into = {"agents": Sharded(part)} if record is not None else {"agents": Sharded(part), "record": EngineRecord(engine)}
    run.load(into)
    loaded = {k: (v.to_local() if world > 1 else v) for k, v in part.fields.items()}
    engine.state.append(loaded)
    if engine.spatial:
        engine._send_strays(0)
    if engine.uses_network:
        engine.arrange_by_id()
    elif engine.model.spatial and engine.cfg.sort_every:
        engine.sort_by_row()
    engine.step_index = meta["step"]
    if record is not None:
        _restore_record(engine, record)
    if dist.is_initialized() and world > 1:
        collectives.barrier()
    return meta


def check_resize(engine: SimEngine, meta: dict, directory: str | Path, run_dir: str | Path | None) -> dict | None:
    """After :func:`load`, in a job of another size than the checkpoint's (or than the run last ran at from it:
    :func:`multigpu.checkpoint.resize.resized_from`): the agents re-partitioned here are
    the ones saved (their state digest equals the saved one, bit for bit), recorded as a resize in ``run_dir``
    (:mod:`multigpu.checkpoint.resize`); rank 0 prints its line. Call on all ranks; returns the check (None: the
    same world size, nothing to check)."""
    from multigpu.checkpoint.resize import digest_check, recorded, resized_from

    rank, world = _world()
    before = resized_from(run_dir, int(meta.get("world_size", world)), world)
    if before is None:
        return None
    check = digest_check(meta.get("state_digest"), state_digest(engine), ["agents"])  # a collective
    if rank == 0:
        print(recorded("sim", run_dir, from_ranks=before, to_ranks=world, step=engine.step_index,
                       checkpoint=directory, check=check), flush=True)
    return check


def _check_compatible(engine: SimEngine, meta: dict, directory: Path) -> None:
    if not isinstance(meta, dict) or "step" not in meta:
        raise ConfigError(f"checkpoint {directory} is not a simulation checkpoint; valid: a checkpoints/step_* "
                          "folder written by multigpu sim")
    mine = {"model": engine.cfg.model, "seed": engine.cfg.seed, "grid": list(engine.cfg.grid),
            "num_agents": engine.num_agents, "params": dict(engine.cfg.params)}
    for key, value in mine.items():
        if meta[key] != value:
            raise ConfigError(f"checkpoint {directory} has {key}={meta[key]!r} but this run has {value!r}; "
                              "resume with the same settings or start a new run directory")
