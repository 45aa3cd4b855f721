"""Reading ``torch.distributed.checkpoint`` folders without letting them run code (the store's sharded parts).

DCP's ``.metadata`` is a pickle, and torch's own reader unpickles it with ``pickle.load``: a crafted file
runs code. Everything here reads it instead, for both kinds of sharded checkpoint this package writes:

* :func:`read_metadata` unpickles ``.metadata`` with :class:`MetadataUnpickler`, which builds only DCP's own
  metadata classes, ``torch.Size``, dtypes and paths, and refuses any other global (a function call, a class
  from elsewhere) with one line naming it; the result must describe tensors only, stored in files of the folder;
* :func:`load` hands torch that result (:class:`VerifiedReader`: torch never unpickles the file itself, nor a
  rank-local ``__<rank>.metadata``), and a planner that refuses byte entries (torch would load those with
  ``weights_only=False``); the tensor files are read with ``weights_only=True``. A tensor file that cannot be
  read (cut short, or altered, behind a manifest rewritten to match) is one line naming it
  (:func:`unreadable_file`), never torch's traceback.

The checkpoint store (:mod:`multigpu.checkpoint.store`) checks ``.metadata``'s size and SHA-256 against the
folder's manifest before it gets here. A checksum shows that a checkpoint is the one a known
run wrote; it cannot show who wrote a folder someone hands you: resume only from a trusted source.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader

from multigpu.errors import CorruptCheckpointError

__all__ = ["METADATA", "MetadataUnpickler", "TensorsOnlyPlanner", "VerifiedReader", "load", "read_metadata"]

METADATA = ".metadata"  # DCP's file name

# What a DCP .metadata of tensors is built from; any other global is refused.
METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
                 "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a name such as "torch.strided" to the layout
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle._Unpickler):
    """``pickle`` restricted to :data:`METADATA_CLASSES` and torch dtypes (the Python docs' "restricting
    globals"), and BUILD to instances of those classes, so that a crafted file can neither call a function
    nor change a class."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed")

    def _load_build(self) -> None:
        inst = self.stack[-2]  # under the state, which BUILD pops
        if isinstance(inst, type) or (type(inst).__module__, type(inst).__qualname__) not in METADATA_CLASSES:
            raise pickle.UnpicklingError(f"setting the state of {type(inst).__qualname__} is not allowed")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _load_build


def read_metadata(directory: Path) -> dcp_metadata.Metadata:
    """``.metadata`` through :class:`MetadataUnpickler`, checked to describe only tensors in this folder."""
    data = (directory / METADATA).read_bytes()
    try:
        metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - a refused global, or a file that is not a pickle at all
        raise CorruptCheckpointError(directory, f"{METADATA} is not DCP metadata of tensors ({exc}); "
                                                "it was not loaded and nothing in it ran") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CorruptCheckpointError(directory, f"{METADATA} holds a {type(metadata).__name__}, not DCP metadata")
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, dcp_metadata.TensorStorageMetadata):
            raise CorruptCheckpointError(directory, f"{METADATA} describes {fqn!r} as {type(md).__name__}; "
                                                    "this checkpoint holds tensors only")
    names = {p.name for p in directory.iterdir()}
    for info in (metadata.storage_data or {}).values():
        relative = getattr(info, "relative_path", None)
        if not isinstance(relative, str) or relative not in names:  # a plain file of this folder, no ../
            raise CorruptCheckpointError(directory, f"{METADATA} points at {relative!r}, not a file of the checkpoint")
    return metadata


class VerifiedReader(FileSystemReader):
    """torch's file reader, handed the metadata :func:`read_metadata` built: it never unpickles .metadata.

    ``read_metadata`` takes no ``rank`` keyword, so DCP does not fall back to a rank-local
    ``__<rank>.metadata`` either.
    """

    def __init__(self, directory: Path, metadata: dcp_metadata.Metadata):
        super().__init__(directory)
        self._metadata = metadata

    def read_metadata(self) -> dcp_metadata.Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:
            self._metadata.storage_meta = dcp_metadata.StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """DCP's planner, minus byte entries: torch loads those with ``weights_only=False``."""

    def __init__(self, directory: Path):
        super().__init__()
        self._directory = directory

    def load_bytes(self, read_item, value) -> None:
        raise CorruptCheckpointError(self._directory, f"it holds a pickled entry {read_item.dest_index.fqn!r}; "
                                                      "only tensors are loaded")


def _slices(metadata: dcp_metadata.Metadata) -> dict[str, list[tuple[int, int]]]:
    """Each data file the metadata names, with the (offset, length) of every entry it stores there."""
    found: dict[str, list[tuple[int, int]]] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        with contextlib.suppress(AttributeError, TypeError):
            found.setdefault(str(info.relative_path), []).append((int(info.offset), int(info.length)))
    return found


def unreadable_file(directory: Path, metadata: dcp_metadata.Metadata, *, read: bool = False) -> str | None:
    """Why a data file of ``directory`` cannot be read, naming it, or None: a file missing or cut short of the
    bytes the metadata places in it; with ``read``, also an entry that is no intact torch file (its zip's
    checksums), which takes reading every byte."""
    for name, slices in sorted(_slices(metadata).items()):
        file = directory / name
        try:
            size = file.stat().st_size
        except OSError as exc:
            return f"its file {file} cannot be read ({exc.strerror})"
        end = max((offset + length for offset, length in slices), default=0)
        if size < end:
            return (f"its file {file} cannot be read: it holds {size:,} bytes, and the checkpoint's metadata places "
                    f"data up to byte {end:,} (cut short)")
        if not read:
            continue
        with open(file, "rb") as fh:
            for offset, length in slices:
                fh.seek(offset)
                try:
                    with zipfile.ZipFile(io.BytesIO(fh.read(length))) as entry:
                        bad = entry.testzip()
                except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
                    bad = str(exc) or type(exc).__name__
                if bad is not None:
                    return (f"its file {file} cannot be read: the entry at byte {offset:,} is no intact torch file "
                            f"({bad}); it was altered or damaged")
    return None


def load(state: dict[str, Any], directory: str | Path, metadata: dcp_metadata.Metadata | None = None) -> None:
    """``dcp.load(state)`` from ``directory`` through :func:`read_metadata` and :class:`TensorsOnlyPlanner`.

    ``metadata``: what :func:`read_metadata` returned, when the caller read it already (e.g. to check it before
    building ``state``). Call on all ranks.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    directory = Path(directory)
    metadata = read_metadata(directory) if metadata is None else metadata
    problem = unreadable_file(directory, metadata)  # on every rank alike, before any rank reads: one line each
    if problem is not None:
        raise CorruptCheckpointError(directory, problem)
    try:
        with warnings.catch_warnings():  # one process: DCP warns that it "assumes the intent" to load locally
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=VerifiedReader(directory, metadata), planner=TensorsOnlyPlanner(directory))
    except CheckpointException as exc:  # a rank could not read its part: DCP gathered every rank's traceback
        refused = [e.exc for e in exc.failures.values() if isinstance(getattr(e, "exc", None), CorruptCheckpointError)]
        if refused:
            raise refused[0] from None
        problem = unreadable_file(directory, metadata, read=True)
        first = next((str(getattr(e, "exc", e)).strip().splitlines()[:1] for e in exc.failures.values()), [])
        raise CorruptCheckpointError(directory, problem or (
            f"its files ({', '.join(sorted(_slices(metadata)))}) cannot be read: "
            f"{(first or [type(exc).__name__])[0][:200]}")) from None
