"""The one checkpoint store of every workload: step folders with a checksummed manifest (inside each rank).

A workload names *what* is stateful; the store owns the folders, the manifest, the rotation and the
checks (docs/architecture.md, "The checkpoint store")::

    store = CheckpointStore(run_dir / "checkpoints", keep_last=3)
    state = {"model": model, "optim": opt, "rng": PerRank(RngState()), "progress": progress}
    if ctx.resume_from:                       # resolved once, in the rank entry point
        store.load(ctx.resume_from, state)    # all ranks
    store.save(step, state)                   # all ranks

A part is anything with ``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful``), or a plain value
(a dict, a number, a tensor: saved as it is, read back from what :meth:`CheckpointStore.load` returns).
Where it goes:

* a plain part: rank 0's copy, in ``state.pt`` (``torch.save``; read back with ``weights_only=True``);
* :class:`PerRank` ``(part)``: every rank's copy, gathered to rank 0 into ``state.pt``; on load each rank
  gets its own back (rank ``r`` of a job of another size gets entry ``r % saved``);
* :class:`Sharded` ``(part)``: a state dict of tensors (DTensors under FSDP or a sharded simulation),
  written by every rank with ``torch.distributed.checkpoint`` and resharded to the loading job's layout.

Order: saving takes the sharded parts' state first, then the others; loading restores the plain and
per-rank parts first, then the sharded ones (so a plain part can carry what a sharded one needs).

On disk, one folder per checkpoint::

    checkpoints/
        step_00000040/
            manifest.json    {"format": 2, "step", "world_size", "time", "meta": {...},
                              "files": {name: {"bytes", "sha256"}}}
            state.pt         the plain and per-rank parts (rank 0)
            .metadata, __0_0.distcp, __1_0.distcp, ...   the sharded parts (DCP; absent when there are none)
        step_00000050/ ...

A save is two halves: :meth:`CheckpointStore.snapshot` takes every part's state (copied to host memory
when a background writer will write it: :mod:`multigpu.checkpoint.staging`), and
:meth:`CheckpointStore.write` writes it, on the calling thread or on a writer's
(:class:`multigpu.checkpoint.Checkpointer`), coordinating the ranks through an :class:`Exchange`. It writes
``.step_<n>.tmp/`` first: every rank its DCP shards, rank 0 ``state.pt`` and, last, ``manifest.json``, each
file fsynced while its bytes are read back and hashed; then one rename makes it ``step_<n>/`` and the folders
beyond ``keep_last`` are deleted. A failure on any rank (a full disk) removes the temporary folder and raises
:class:`CheckpointWriteError` on every rank, naming the reason and the previous checkpoint, which is
intact. A process killed mid-save leaves only a hidden ``.step_*.tmp`` folder, which no reader looks at
and the next save deletes.

Loading runs no code from the files: a checkpoint is used only if every file in its folder is listed in
its manifest with the size and SHA-256 it has (:meth:`CheckpointStore.verify`, bytes only, so the
launcher can call it); ``state.pt`` is read with ``torch.load(weights_only=True)``; DCP's ``.metadata``
(a pickle) with a restricted unpickler and its tensor files with ``weights_only=True``
(:mod:`multigpu.checkpoint.dcp_safe`). The checksums show that a checkpoint is the one a run wrote, not who wrote
the folder: resume only from a trusted source.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import shutil
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from multigpu.checkpoint.files import atomic_write, fsync_dir, sha256_file, synced_digest
from multigpu.checkpoint.staging import Stager, landed
from multigpu.errors import CheckpointWriteError, CorruptCheckpointError, OldLayoutError
from multigpu.files import describe_os_error, os_error_in

__all__ = ["MANIFEST", "STATE", "CheckpointStore", "Exchange", "PerRank", "Scan", "Sharded", "Snapshot",
           "describe_unusable", "is_checkpoint", "old_layout_error", "read_manifest", "verify"]

MANIFEST = "manifest.json"
STATE = "state.pt"
FORMAT = 2
PREFIX = "step_"
_STEP = re.compile(r"^step_(\d{8,})$")


class PerRank:
    """A part whose value differs per rank (random state, environments): every rank's copy is saved."""

    def __init__(self, part: Any):
        self.part = part


class Sharded:
    """A part saved by every rank with ``torch.distributed.checkpoint`` (tensors only), resharded on load."""

    def __init__(self, part: Any):
        self.part = part


def _state_of(part: Any) -> Any:
    return part.state_dict() if hasattr(part, "state_dict") else part


def _restore(part: Any, value: Any) -> None:
    if hasattr(part, "load_state_dict"):
        part.load_state_dict(value)


def _warn(message: str) -> None:
    from multigpu.runtime.logging import get_logger

    get_logger().warning(message)


# ----------------------------------------------------------------------------- checks (bytes only)
def is_checkpoint(path: str | Path) -> bool:
    """A folder with a manifest.json (complete: the manifest is written last)."""
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def read_manifest(path: str | Path) -> dict[str, Any]:
    """``path/manifest.json``, parsed and its shape checked (no checksum is compared): a format-2 manifest
    with a step, a world size and, for every file, a size in bytes and a SHA-256. CorruptCheckpointError
    otherwise (never a TypeError further on: every reader can trust the types)."""
    path = Path(path)
    try:
        data = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CorruptCheckpointError(path, f"it is not a checkpoint folder (no {MANIFEST})") from None
    except RecursionError:  # JSON nested deeper than the reader recurses
        raise CorruptCheckpointError(path, f"its {MANIFEST} is nested too deeply to read") from None
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(path, f"its {MANIFEST} cannot be read ({type(exc).__name__})") from None
    problem = _manifest_problem(data)
    if problem is not None:
        raise CorruptCheckpointError(path, f"its {MANIFEST} {problem}")
    return data


_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _count(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _manifest_problem(data: Any) -> str | None:
    """What makes ``data`` not a manifest this store writes (None: nothing)."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        return f"is not a format-{FORMAT} checkpoint manifest"
    for key, low in (("step", 0), ("world_size", 1)):
        if not _count(data.get(key), low):
            return f"records {key} as {json.dumps(data.get(key))[:40]}, not a whole number >= {low}"
    if not isinstance(data.get("meta", {}), dict):
        return "records meta as something other than a JSON object"
    for name, entry in data["files"].items():
        if not (isinstance(entry, dict) and _count(entry.get("bytes"), 0) and isinstance(entry.get("sha256"), str)
                and _SHA256.match(entry["sha256"])):
            return f"records {name} as {json.dumps(entry)[:80]}, not a size in bytes and a SHA-256"
    return None


def verify(path: str | Path, only: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The manifest of checkpoint folder ``path`` once its files have the recorded sizes and SHA-256.

    Every file of the folder must be listed (a file the manifest does not list has no checksum and is
    never loaded), every listed file present and of the size recorded (a stat: checked for every file). ``only``: compare just these files' checksums (the
    ranks re-check the pickles they are about to read; the resolver checked everything). Reads bytes,
    unpickles nothing; local.

    Raises:
        CorruptCheckpointError: naming the folder and what is wrong.
    """
    path = Path(path)
    manifest = read_manifest(path)
    files = manifest["files"]
    present = {p.name for p in path.iterdir() if p.name != MANIFEST}
    for name in sorted(present - set(files)):
        raise CorruptCheckpointError(path, f"{name} is not listed in its {MANIFEST}, so it has no checksum to "
                                           "verify it by and the folder is not loaded")
    for name, entry in files.items():
        if Path(name).name != name or name not in present or not (path / name).is_file():
            raise CorruptCheckpointError(path, f"{name} is missing")
        _check_size(path, name, (path / name).stat().st_size, entry["bytes"])  # cheap: every file, hashed or not
        if only is not None and name not in only:
            continue
        size, digest = sha256_file(path / name)  # read_manifest checked the entry: an int and a hex string
        _check_size(path, name, size, entry["bytes"])
        if digest != entry["sha256"]:
            raise CorruptCheckpointError(path, f"{name}: checksum mismatch (SHA-256 {digest[:16]}… on disk, "
                                               f"{entry['sha256'][:16]}… written): it was altered or "
                                               "damaged after it was saved")
    if STATE in files and (only is None or STATE in only):
        _refuse_globals(path / STATE)
    return manifest


def _check_size(path: Path, name: str, size: int, written: int) -> None:
    if size != written:
        what = "truncated" if size < written else "not the size written"
        raise CorruptCheckpointError(path, f"{name} is {what} ({size:,} bytes on disk, {written:,} written)")


def _refuse_globals(path: Path) -> None:
    """A pickle that names anything but tensors and plain values is refused without being unpickled: torch
    lists the globals it refers to by reading its opcodes (a checksum shows a file is unchanged, not safe)."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as exc:  # noqa: BLE001 - not a torch.save file at all
        raise CorruptCheckpointError(path, f"it is not a torch.save file ({type(exc).__name__})") from None
    if found:
        named = ", ".join(sorted(found)[:4])  # torch's list has no fixed order
        raise CorruptCheckpointError(path, f"it refers to {named}, which is not a tensor or plain value; "
                                           "checkpoints are loaded with weights_only=True, so it was not loaded "
                                           "and nothing in it ran")


def old_layout(directory: Path) -> str | None:
    """What marks ``directory`` as written by an earlier multigpu (None: nothing does)."""
    if not directory.is_dir():
        return None
    names = {p.name for p in directory.iterdir()}
    old = sorted(n for n in names if n.startswith("ckpt_") and n.endswith(".pt"))
    if old or MANIFEST in names:
        return f"{old[0] if old else MANIFEST} (one file per checkpoint)"
    for p in directory.iterdir():
        if p.name.startswith(PREFIX) and (p / "engine.json").is_file() and not (p / MANIFEST).is_file():
            return f"{p.name}/engine.json (a simulation checkpoint)"
        if _STEP.match(p.name) and (p / "trainer.pt").is_file():
            return f"{p.name}/trainer.pt (a sharded training checkpoint)"
    return None


def old_layout_error(directory: Path, what: str) -> OldLayoutError:
    """The one-line error for ``directory``, which holds checkpoints of an earlier layout (``what``: the files
    :func:`old_layout` found), for the store and the resume decision alike."""
    return OldLayoutError(f"{directory} holds checkpoints of an earlier multigpu layout ({what}), which this "
                          f"version does not read; valid: start the run again in a new --run-dir (each checkpoint "
                          f"is now a step_*/ folder with its own {MANIFEST})")


def _torch_load(path: Path) -> Any:
    """``torch.load(weights_only=True)``; one line naming what the weights-only unpickler refused."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"unrecognized function (\S+)", text)
        why = (f"it refers to {found[1]}, which is not a tensor or plain value; checkpoints are loaded with "
               "weights_only=True, so it was not loaded and nothing in it ran") if found else \
            "it does not load with weights_only=True"
        raise CorruptCheckpointError(path, why) from None
    except Exception as exc:  # noqa: BLE001 - any other failure to read it: the file is unusable
        raise CorruptCheckpointError(path, f"it does not load ({type(exc).__name__})") from None


@contextlib.contextmanager
def _quiet():
    """DCP in one process warns that it "assumes the intent" to save or load locally: it is the intent. (On a
    writer thread the checkpointer filtered it for the process: ``catch_warnings`` is not thread-safe.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _failed_rank(exc: BaseException, rank: int) -> int:
    """The rank whose disk failed: DCP reports one rank's failure on every rank (its ``CheckpointException``
    maps each failed rank to its exception); ``rank`` when it names none."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict):
        failed = sorted(r for r, f in failures.items()
                        if isinstance(r, int) and os_error_in(f[0] if isinstance(f, tuple) and f else f) is not None)
        if failed:
            return failed[0]
    return rank


# ----------------------------------------------------------------------------- saving in two halves
@dataclass
class Snapshot:
    """A checkpoint's content, taken at one step (:meth:`CheckpointStore.snapshot`), not yet written."""

    step: int
    rank: int
    world: int
    sharded: dict[str, Any]
    """Name -> DCP state dict (every rank writes its shards)."""
    per_rank: dict[str, Any]
    """Name -> this rank's state (gathered to rank 0)."""
    plain: dict[str, Any]
    """Name -> state (rank 0's; empty elsewhere)."""
    meta: dict[str, Any]
    ready: list = field(default_factory=list)
    """CUDA events after the staging copies (:func:`~multigpu.checkpoint.staging.landed`); empty: nothing to wait."""


class Exchange:
    """The collectives a write coordinates the ranks with: the job's own (``group=None``: multigpu's collectives
    on the default group, named in errors and timed into the step) or those of a process group of its own,
    called with ``torch.distributed`` directly (a background writer: its messages never pair with the main
    thread's on the default group, and its time is not the step's)."""

    def __init__(self, group: Any = None):
        self.group = group

    def broadcast(self, obj: Any) -> Any:
        if self.group is None:
            from multigpu.runtime import collectives

            return collectives.broadcast_object(obj)
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank 0 (None elsewhere)."""
        if self.group is None:
            from multigpu.runtime import collectives

            return collectives.gather(obj, dst=0)
        import torch.distributed as dist

        parts = [None] * dist.get_world_size(self.group) if dist.get_rank(self.group) == 0 else None
        dist.gather_object(obj, parts, dst=0, group=self.group)
        return parts


# ----------------------------------------------------------------------------- the store
class CheckpointStore:
    """``step_<n>/`` checkpoint folders in ``directory``, the newest ``keep_last`` kept.

    Args:
        directory: The folder (``<run_dir>/checkpoints``; created on the first save).
        keep_last: Checkpoints kept; older ones are deleted after each successful save.
        warn: Called with one line for each checkpoint :meth:`latest` skips (default: the rank's logger).
    """

    def __init__(self, directory: str | Path, keep_last: int = 3, *, warn: Callable[[str], None] | None = None):
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.warn = warn or _warn
        self._verified: dict[Path, tuple] = {}  # folder -> what its files looked like when it last verified
        self._named: set[Path] = set()  # folders rotation left alone and already said so
        self.skipped: list[tuple[Path, str]] = []  # what the last latest() skipped, and why

    def path_for(self, step: int) -> Path:
        return self.directory / f"{PREFIX}{int(step):08d}"

    def _step_folders(self) -> list[Path]:
        """Every ``step_<n>`` folder, oldest step first (complete or not, valid or not)."""
        if not self.directory.is_dir():
            return []
        found = [p for p in self.directory.iterdir() if _STEP.match(p.name) and p.is_dir() and not p.is_symlink()]
        return sorted(found, key=lambda p: int(_STEP.match(p.name)[1]))

    def own_problem(self, path: Path) -> str | None:
        """What makes folder ``path`` not a checkpoint of this store's layout (None: it is one). Its manifest
        must check out (:func:`read_manifest`) and record the step its folder is named after; the checksums are
        not compared here."""
        try:
            manifest = read_manifest(path)
        except CorruptCheckpointError as exc:
            return exc.reason
        if manifest["step"] != int(_STEP.match(path.name)[1]):
            return f"its {MANIFEST} records step {manifest['step']}, not the step its folder is named after"
        return None

    def folders(self) -> list[Path]:
        """This store's checkpoint folders (a manifest of its layout naming the folder's step; checksums not
        compared), oldest step first."""
        return [p for p in self._step_folders() if self.own_problem(p) is None]

    # ------------------------------------------------------------------ reading
    def verify(self, path: str | Path) -> dict[str, Any]:
        """:func:`verify`: the manifest once every file checks out (bytes only)."""
        return verify(path)

    def scan(self, *, checksums: bool = True) -> Scan:
        """The newest ``step_*`` folder that verifies, and why each newer one cannot be used (newest first;
        when none verifies: every folder's reason). Warns nothing; local, bytes only.

        ``checksums=False``: its manifest and the files it lists are there, their bytes not read (the launcher's
        look ahead; the ranks compare every checksum).

        Raises:
            OldLayoutError: there is none, but the folder holds checkpoints of an earlier layout.
        """
        unusable: list[tuple[Path, str]] = []
        for path in reversed(self._step_folders()):
            try:
                verify(path, only=None if checksums else ())
                return Scan(path, unusable)
            except CorruptCheckpointError as exc:
                unusable.append((path, exc.reason))
        what = old_layout(self.directory)
        if what is not None:
            raise old_layout_error(self.directory, what)
        return Scan(None, unusable)

    def latest(self, *, checksums: bool = True) -> Path | None:
        """The newest checkpoint that verifies, else None; each one skipped is warned with its reason (a
        ``step_*`` folder without a manifest too: saves write a hidden folder until complete). Local.
        ``self.skipped`` keeps why each was skipped, newest first (:meth:`scan` says it without warning).
        ``checksums``: as :meth:`scan`'s.

        Raises:
            OldLayoutError: there is none, but the folder holds checkpoints of an earlier layout.
        """
        found, unusable = self.scan(checksums=checksums)
        self.skipped = unusable
        for path, reason in unusable:
            self.warn(f"skipping checkpoint {path} (unusable: {reason})")
        return found

    def load(self, path: str | Path, into: dict[str, Any]) -> dict[str, Any]:
        """Restore the parts of ``into`` from checkpoint ``path``. Call on all ranks.

        Stateful parts get ``load_state_dict``; the return value maps every saved name to its value (a
        :class:`PerRank` part's: this rank's), plus ``"_manifest"``, the folder's manifest (``meta``,
        ``step``, ``world_size``).

        Raises:
            CorruptCheckpointError: the files fail their checksums, or hold more than tensors and plain values.
            OldLayoutError: ``path`` was written by an earlier layout.
        """
        from multigpu.runtime import group

        path = Path(path)
        if not is_checkpoint(path) and old_layout(path.parent if path.is_file() else path) is not None:
            raise old_layout_error(path, old_layout(path.parent if path.is_file() else path))
        manifest = verify(path, only=(STATE, ".metadata"))  # the pickles this rank reads; the rest: weights only
        saved = _torch_load(path / STATE) if STATE in manifest["files"] else {}
        if not isinstance(saved, dict):
            raise CorruptCheckpointError(path, f"its {STATE} holds a {type(saved).__name__}, not a dict of parts")
        rank = group.rank() if group.is_initialized() else 0
        out: dict[str, Any] = {"_manifest": manifest}
        sharded = {name: part.part for name, part in into.items() if isinstance(part, Sharded)}
        for name, part in into.items():
            if isinstance(part, Sharded):
                continue
            if name not in saved:
                raise CorruptCheckpointError(path, f"it holds no {name!r} (it holds {', '.join(sorted(saved))})")
            value = saved[name]
            if isinstance(part, PerRank):
                if not isinstance(value, list) or not value:
                    raise CorruptCheckpointError(path, f"its {name!r} is not a list of every rank's state")
                value = value[rank % len(value)]
                part = part.part
            _restore(part, value)
            out[name] = value
        if sharded:
            self._load_sharded(path, sharded)
        return out

    def _load_sharded(self, path: Path, parts: dict[str, Any]) -> None:
        from multigpu.checkpoint import dcp_safe

        if ".metadata" not in verify(path, only=())["files"]:
            raise CorruptCheckpointError(path, f"it holds no sharded state ({', '.join(parts)})")
        metadata = dcp_safe.read_metadata(path)  # before anything is built: a refused file changes nothing
        states = {name: _state_of(part) for name, part in parts.items()}  # this job's layout, filled in place
        with _quiet():
            dcp_safe.load(states, path, metadata)
        for name, part in parts.items():
            _restore(part, states[name])

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: dict[str, Any], *, meta: dict[str, Any] | None = None) -> Path:
        """Write checkpoint ``step`` of ``state`` now (see the module docstring). Call on all ranks.

        ``meta``: plain JSON values recorded in the manifest, read without unpickling anything (the
        launcher checks a resume against them).

        Raises:
            CheckpointWriteError: on every rank, when a rank could not write (disk full, permission);
                the previous checkpoints are intact and no temporary folder is left.
        """
        return self.write(self.snapshot(step, state, meta=meta))

    def snapshot(self, step: int, state: dict[str, Any], *, meta: dict[str, Any] | None = None,
                 stager: Stager | None = None) -> Snapshot:
        """What checkpoint ``step`` will hold: every part's state, taken now (the sharded parts first, then the
        others). Local: no collective, nothing written.

        ``stager``: copy it into host memory (:mod:`~multigpu.checkpoint.staging`), so that :meth:`write` can
        run on another thread while the run changes the live state; None: the live state itself (write at once).
        """
        from multigpu.runtime import group

        many = group.is_initialized() and group.world_size() > 1
        rank, world = (group.rank(), group.world_size()) if many else (0, 1)
        sharded = {name: _state_of(p.part) for name, p in state.items() if isinstance(p, Sharded)}
        per_rank = {name: _state_of(p.part) for name, p in state.items() if isinstance(p, PerRank)}
        plain = {name: _state_of(p) for name, p in state.items() if not isinstance(p, (Sharded, PerRank))} \
            if rank == 0 else {}  # written by rank 0 only
        meta = dict(meta or {})
        ready: list = []
        if stager is not None:
            if sharded:
                sharded = stager.stage_sharded(sharded)
            # the device copies only queued: the writer waits for them (ready), the run goes on at once
            copied, ready = stager.stage({"per_rank": per_rank, "plain": plain, "meta": meta}, wait=False)
            per_rank, plain, meta = copied["per_rank"], copied["plain"], copied["meta"]
        return Snapshot(int(step), rank, world, sharded, per_rank, plain, meta, ready)

    def write(self, snap: Snapshot, exchange: Exchange | None = None) -> Path:
        """Write ``snap`` as ``step_<n>/``: the temporary folder, every rank's DCP shards, rank 0's ``state.pt``
        and manifest, the rename, the rotation. Call on all ranks, on one thread each.

        ``exchange``: the collectives it coordinates the ranks with (default: the job's own, on the calling
        thread; a background writer passes a process group of its own, :class:`Exchange`).

        Raises:
            CheckpointWriteError: on every rank, when a rank could not write; see :meth:`save`.
        """
        exchange = exchange or Exchange()
        landed(snap.ready)  # the staged copies from the GPU are in host memory
        rank, many = snap.rank, snap.world > 1
        final = self.path_for(snap.step)
        tmp = self.directory / f".{final.name}.tmp"
        failure = None
        if rank == 0:
            failure = self._begin(tmp)
        if many:
            failure = exchange.broadcast(failure)
        if failure is not None:
            raise CheckpointWriteError(failure)
        mine: dict[str, dict[str, Any]] = {}
        if snap.sharded:
            import torch.distributed.checkpoint as dcp

            try:
                with _quiet():  # the files fsynced below, each while it is read back and hashed
                    dcp.save(snap.sharded, storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=False),
                             process_group=exchange.group)
                names = list(tmp.glob(f"__{rank}_*.distcp")) + ([tmp / ".metadata"] if rank == 0 else [])
                mine = {p.name: dict(zip(("bytes", "sha256"), synced_digest(p), strict=True)) for p in names}
            except BaseException as exc:  # DCP's CheckpointException is a BaseException, not an Exception
                cause = os_error_in(exc) if not isinstance(exc, (KeyboardInterrupt, SystemExit)) else None
                if cause is None:  # only a disk's failure is reported; the rest re-raised
                    raise
                failure = f"rank {_failed_rank(exc, rank)}: {describe_os_error(cause)}"
        mine_all = {"files": mine, "failure": failure, "per_rank": snap.per_rank}
        parts = exchange.gather(mine_all) if many else [mine_all]
        if rank == 0:
            failure = next((p["failure"] for p in parts if p["failure"]), None)
            if failure is None:
                plain = dict(snap.plain)
                plain.update({name: [p["per_rank"][name] for p in parts] for name in snap.per_rank})
                files: dict[str, Any] = {}
                for p in parts:
                    files.update(p["files"])
                failure = self._finish(tmp, final, snap.step, snap.world, plain, files, snap.meta)
            if failure is not None:
                shutil.rmtree(tmp, ignore_errors=True)
                previous = [p.name for p in self.folders() if p != final]
                intact = f"the previous checkpoint {previous[-1]} is intact" if previous else \
                    "no earlier checkpoint exists"
                failure = f"could not write checkpoint {final}: {failure}; {intact}"
        if many:
            failure = exchange.broadcast(failure)  # also the sync point: all ranks see the folder
        if failure is not None:
            raise CheckpointWriteError(failure)
        return final

    def _begin(self, tmp: Path) -> str | None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(f".{PREFIX}*.tmp"):  # left by a process killed mid-save
                if stale.is_symlink():  # not ours: a link is removed, never followed (mkdir below refuses one)
                    stale.unlink()
                else:
                    shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            return f"could not write checkpoint {tmp.parent}: {describe_os_error(exc)}"
        return None

    def _finish(self, tmp: Path, final: Path, step: int, world: int, plain: dict, files: dict,
                meta: dict) -> str | None:
        """Rank 0: state.pt, the manifest, the rename, the rotation. Returns what failed, or None."""
        try:
            if plain:
                size, digest = atomic_write(tmp / STATE, lambda fh: torch.save(plain, fh))
                files[STATE] = {"bytes": size, "sha256": digest}
            text = json.dumps({"format": FORMAT, "step": int(step), "world_size": world,
                               "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "meta": meta, "files": files},
                              indent=2).encode()
            atomic_write(tmp / MANIFEST, lambda fh: fh.write(text))
            if final.exists():  # the same step again (a resumed run that repeats it): replace it
                shutil.rmtree(final)
            tmp.rename(final)
            fsync_dir(self.directory)
        except Exception as exc:  # noqa: BLE001 - only a disk's failure is reported; the rest re-raised
            cause = os_error_in(exc)
            if cause is None:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            return describe_os_error(cause)
        self._verified[final] = _look(final)  # its checksums were computed from the bytes just written
        self._rotate(final)
        return None

    def _rotate(self, final: Path) -> None:
        """Delete this store's checkpoints older than the newest ``keep_last`` valid ones (``final``, just written,
        is one of them and is never deleted; nor is a folder of a higher step). A checkpoint counts only if it
        verifies, as resume would use it, and only a folder of this store's layout is deleted: one it does not
        understand (a stray or planted ``step_*/manifest.json``) is left alone and named once."""
        valid_newer = 0
        for path in reversed(self._step_folders()):
            if path == final:
                valid_newer += 1
                continue
            problem = self.own_problem(path)
            if problem is not None:
                if path not in self._named and (path / MANIFEST).exists():  # a save in progress has no manifest
                    self._named.add(path)
                    self.warn(f"checkpoint rotation: {path} is left alone ({problem}, so it is not a checkpoint "
                              "this run wrote and it is never deleted; remove it yourself if it is not needed)")
                continue
            if int(_STEP.match(path.name)[1]) < int(_STEP.match(final.name)[1]) and valid_newer >= self.keep_last:
                shutil.rmtree(path, ignore_errors=True)
                self._verified.pop(path, None)
            elif self._is_valid(path):
                valid_newer += 1

    def _is_valid(self, path: Path) -> bool:
        """Whether ``path`` verifies; a folder whose files are unchanged since it last did is not hashed again."""
        look = _look(path)
        if self._verified.get(path) == look:
            return True
        try:
            verify(path)
        except CorruptCheckpointError:
            return False
        self._verified[path] = look
        return True


class Scan(NamedTuple):
    """What :meth:`CheckpointStore.scan` found: the checkpoint to use, and each newer one's reason it is unusable."""

    found: Path | None
    unusable: list[tuple[Path, str]]


def describe_unusable(unusable: list[tuple[Path, str]]) -> str:
    """``step_a: reason; step_b: reason`` (one line, the folders by name) for a message about :meth:`~CheckpointStore.scan`."""
    return "; ".join(f"{path.name}: {reason}" for path, reason in unusable)


def _look(path: Path) -> tuple:
    """The name, size and modification time of every file in ``path``: what a change to it would alter."""
    try:
        return tuple(sorted((p.name, st.st_size, st.st_mtime_ns) for p in path.iterdir() for st in [p.stat()]))
    except OSError:
        return ()
