"""Agent tables in files: populations read in chunks, final agents written by id (both sides of the launch).

A population file holds one column per agent field, one row per agent; row
``i`` is agent ``i`` (an ``id`` column, if present, must read 0, 1, 2, ... as
one written by ``--save-agents`` does). Formats, by name:

* ``pop.npz``: one array per field (``np.savez(path, x=..., y=..., state=...)``);
* ``pop/`` (a folder): ``<field>.npy`` per field;
* ``pop.csv``: a header line with the field names, then one line per agent;
* ``pop.parquet``: one column per field (needs ``pip install pyarrow``).

Columns that are not fields of the model are refused by name; fields with
no column come from the model's ``init``. Each rank reads only its own rows,
a chunk at a time (``.npy`` memory-mapped, ``.npz`` members and Parquet row
groups seeked, CSV scanned line by line), and spatial strategies then send
each agent to the rank that owns its row, so memory per rank stays
O(agents / ranks).

``save(engine, path)`` writes the final agents ordered by id, independent of
the split: each rank first sends its agents to the rank owning their id range,
then a folder of ``.npy`` is written by every rank in place (memory-mapped), and
``.npz`` / Parquet by rank 0, one rank's slice at a time. It writes into a new
temporary sibling and renames it into place; an existing ``path`` is replaced
only when it is an agent table itself (``check_target``): a folder holding
anything else (a thesis, a run directory) is refused, never deleted.
"""

from __future__ import annotations

import contextlib
import csv
import itertools
import math
import os
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from multigpu.errors import ConfigError, OutputError
from multigpu.files import cannot_write, replace_files, user_made, user_umask

__all__ = ["agents_by_id", "check_target", "check_values", "columns", "id_range", "import_pyarrow", "num_rows",
           "read_headers", "read_rows", "save", "unused_value"]

_SUFFIXES = (".npz", ".csv", ".parquet")


def _kind(path: Path) -> str:
    if path.suffix in _SUFFIXES:
        return path.suffix[1:]
    if path.suffix == ".npy":
        raise ConfigError(f"sim.population {str(path)!r}: a single .npy is one field; give the folder of "
                          "<field>.npy files, or an .npz, .csv or .parquet")
    return "npy"


def import_pyarrow():
    """``pyarrow`` with its ``parquet`` module, else one ConfigError with the install hint."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ConfigError("Parquet files need pyarrow: pip install pyarrow (or use .npz, .csv or a folder of .npy)"
                          ) from None
    return pyarrow


def _npy_header(fp) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(fp)
    shape, fortran, dtype = (np.lib.format.read_array_header_1_0(fp) if version == (1, 0)
                             else np.lib.format.read_array_header_2_0(fp))
    if fortran and len(shape) > 1:
        raise ValueError("Fortran-ordered arrays are not supported")
    return shape, dtype


def _check_length(path: Path, name: str, shape: tuple[int, ...], dtype: np.dtype, start: int, size: int) -> None:
    """A column's data is all there (a member cut short reads as fewer rows, far from here) and holds numbers."""
    if dtype.hasobject:
        raise ConfigError(f"sim.population {str(path)!r}: column {name!r} holds Python objects (dtype {dtype}), "
                          "which would need unpickling; valid: numeric columns (integers or floats)")
    need = start + math.prod(shape) * dtype.itemsize
    if size < need:
        have = max(size - start, 0) // max(dtype.itemsize, 1)
        raise ConfigError(f"sim.population {str(path)!r}: column {name!r} declares {shape[0] if shape else 0:,} rows "
                          f"but holds {have:,} ({size:,} of {need:,} bytes): the file is cut short; valid: a "
                          "complete file (write it again)")


def read_headers(path: Path) -> dict[str, tuple[int, np.dtype | None]]:
    """A population (or edge) file's column -> (rows, numpy dtype or None for CSV), reading headers only."""
    kind = _kind(path)
    if not path.exists():
        raise ConfigError(f"sim.population {str(path)!r} does not exist; valid: an .npz, .csv, .parquet file or a "
                          "folder of <field>.npy")
    try:
        if kind == "npz":
            out = {}
            with zipfile.ZipFile(path) as zf:
                for info in zf.infolist():
                    if info.filename.endswith(".npy"):
                        with zf.open(info) as fp:
                            shape, dtype = _npy_header(fp)
                            _check_length(path, info.filename[:-4], shape, dtype, fp.tell(), info.file_size)
                        out[info.filename[:-4]] = (shape, dtype)
        elif kind == "npy":
            out = {}
            for p in sorted(path.glob("*.npy")):
                with open(p, "rb") as fp:
                    out[p.stem] = _npy_header(fp)
                    _check_length(path, p.stem, *out[p.stem], fp.tell(), p.stat().st_size)
        elif kind == "csv":
            with open(path, newline="") as fh:
                header = next(csv.reader(fh), [])
                rows = sum(1 for line in fh if line.strip())
            return {name.strip(): (rows, None) for name in header}
        else:
            meta = import_pyarrow().parquet.ParquetFile(path)
            return {f.name: (meta.metadata.num_rows, np.dtype(f.type.to_pandas_dtype())) for f in meta.schema_arrow}
    except ConfigError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise ConfigError(f"sim.population {str(path)!r} cannot be read as {kind}: {exc}") from None
    for name, (shape, _) in out.items():
        if len(shape) != 1:
            raise ConfigError(f"sim.population {str(path)!r}: column {name!r} has shape {shape}; valid: 1-D")
    return {name: (shape[0], dtype) for name, (shape, dtype) in out.items()}


def columns(path: str | Path, fields: Mapping[str, torch.dtype]) -> tuple[int, list[str]]:
    """(rows, the file's columns) after checking them against the model's ``fields``. Reads headers only."""
    path = Path(path)
    heads = read_headers(path)
    if not heads:
        raise ConfigError(f"sim.population {str(path)!r} has no columns")
    unknown = sorted(set(heads) - set(fields))
    if unknown:
        raise ConfigError(f"sim.population {str(path)!r}: column(s) {unknown} are not fields of the model; "
                          f"valid: {', '.join(fields)}")
    sizes = {n for n, _ in heads.values()}
    if len(sizes) != 1:
        raise ConfigError(f"sim.population {str(path)!r}: columns differ in length "
                          f"({', '.join(f'{k}: {n}' for k, (n, _) in heads.items())})")
    for name, (_, dtype) in heads.items():
        if dtype is not None and dtype.kind == "f" and not fields[name].is_floating_point:
            raise ConfigError(f"sim.population {str(path)!r}: column {name!r} holds floats ({dtype}) but the field "
                              f"is {str(fields[name]).removeprefix('torch.')}; write it as integers")
    rows = sizes.pop()
    if rows < 1:
        raise ConfigError(f"sim.population {str(path)!r} has no rows")
    return rows, list(heads)


def num_rows(path: str | Path) -> int:
    """Rows of a population file (headers only; a CSV is counted line by line)."""
    return next(iter(read_headers(Path(path)).values()))[0]


# ----------------------------------------------------------------------------- reading
def _read_npy(fp, lo: int, hi: int, base: int = 0) -> np.ndarray:
    shape, dtype = _npy_header(fp)
    start = fp.tell() if base == 0 else base
    fp.seek(start + lo * dtype.itemsize)
    data = fp.read((hi - lo) * dtype.itemsize)
    return np.frombuffer(data, dtype=dtype).copy()


def _read_block(path: Path, kind: str, names: list[str], lo: int, hi: int, state: dict) -> dict[str, np.ndarray]:
    if kind == "npy":
        return {n: np.array(np.load(path / f"{n}.npy", mmap_mode="r")[lo:hi]) for n in names}
    if kind == "npz":
        zf = state.setdefault("zip", zipfile.ZipFile(path))
        out = {}
        for n in names:
            with zf.open(f"{n}.npy") as fp:
                out[n] = _read_npy(fp, lo, hi)
        return out
    if kind == "csv":  # lines are read in order: state keeps the open file and the next row
        fh, at = state.get("csv", (None, 0))
        if fh is None or at > lo:
            fh = open(path, newline="")  # noqa: SIM115 - closed in read_rows
            header = [h.strip() for h in next(csv.reader([fh.readline()]))]
            state["header"], at = header, 0
        lines = list(itertools.islice(fh, lo - at, hi - at))
        state["csv"] = (fh, hi)
        header = state["header"]
        try:
            table = np.loadtxt(lines, delimiter=",", ndmin=2, dtype=str)
        except ValueError as exc:
            raise ValueError(f"population {path}: rows {lo}..{hi}: {exc}") from None
        if table.shape[0] != hi - lo or (table.size and table.shape[1] != len(header)):
            raise ValueError(f"population {path}: rows {lo}..{hi} do not have {len(header)} columns each")
        return {n: table[:, header.index(n)] for n in names}
    pq = import_pyarrow().parquet.ParquetFile(path)
    parts, start = {n: [] for n in names}, 0
    for g in range(pq.num_row_groups):
        count = pq.metadata.row_group(g).num_rows
        if start < hi and start + count > lo:
            table = pq.read_row_group(g, columns=names)
            a, b = max(lo - start, 0), min(hi, start + count) - start
            for n in names:
                parts[n].append(table.column(n).to_numpy()[a:b])
        start += count
    return {n: np.concatenate(v) if v else np.zeros(0) for n, v in parts.items()}


def _to_field(values: np.ndarray, dtype: torch.dtype, name: str, path: Path, what: str) -> torch.Tensor:
    """Column values as the field's dtype; refused when they do not fit (never silently wrapped or rounded)."""
    if values.dtype.kind in "UO":  # CSV text
        try:
            values = values.astype(np.float64 if dtype.is_floating_point else np.int64)
        except ValueError:
            raise ValueError(f"{what} {path}: column {name!r} holds text that is not a "
                             f"{'number' if dtype.is_floating_point else 'whole number'}") from None
    tensor = torch.from_numpy(np.ascontiguousarray(values))
    if not dtype.is_floating_point and tensor.numel():
        kind = str(dtype).removeprefix("torch.")
        if tensor.is_floating_point():
            raise ValueError(f"{what} {path}: column {name!r} holds floats ({values.dtype}); valid: whole numbers "
                             f"({kind}) written as integers")
        info = torch.iinfo(dtype) if dtype is not torch.bool else None
        low, high = (0, 1) if info is None else (info.min, info.max)
        if int(tensor.min()) < low or int(tensor.max()) > high:
            raise ValueError(f"{what} {path}: column {name!r} has values outside {kind} "
                             f"({int(tensor.min())}..{int(tensor.max())})")
    return tensor.to(dtype)


def read_rows(path: str | Path, fields: Mapping[str, torch.dtype], lo: int, hi: int,
              chunk: int, what: str = "population") -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
    """Rows ``[lo, hi)`` of the file, ``chunk`` rows at a time: (first row, {column: tensor of the field dtype}).

    Only the file's columns are returned (the caller fills the other fields). ``what`` names the file in errors.
    """
    path = Path(path)
    kind = _kind(path)
    names = [n for n in read_headers(path) if n in fields]
    state: dict = {}
    try:
        for start in range(lo, hi, chunk):
            stop = min(start + chunk, hi)
            block = _read_block(path, kind, names, start, stop, state)
            yield start, {n: _to_field(block[n], fields[n], n, path, what) for n in names}
    finally:
        if "zip" in state:
            state["zip"].close()
        if state.get("csv", (None,))[0] is not None:
            state["csv"][0].close()


def unused_value(column: torch.Tensor, allowed: Mapping[int, str]) -> tuple[int, int] | None:
    """(index, value) of the first entry of ``column`` that is not a key of ``allowed``; None when all are."""
    ok = torch.isin(column.to(torch.int64), torch.tensor(sorted(allowed), dtype=torch.int64))
    if bool(ok.all()):
        return None
    first = int(torch.nonzero(~ok)[0, 0])
    return first, int(column[first])


def unused_value_message(path: str | Path, name: str, row: int, value: int, model: str,
                         allowed: Mapping[int, str]) -> str:
    valid = ", ".join(f"{v} ({label})" for v, label in sorted(allowed.items()))
    return (f"sim.population {str(path)!r}: column {name!r} holds {value} in row {row:,}, a value model {model!r} "
            f"does not use; valid: {valid}")


def check_values(path: str | Path, model, params, chunk: int = 1 << 20) -> None:
    """Refuse (one-line ConfigError) the first row whose column holds a value ``model`` does not use
    (:attr:`multigpu.sim.api.Model.values`). Reads only those columns, ``chunk`` rows at a time."""
    allowed = model.values(params) if model.values is not None else {}
    fields = {n: model.fields[n] for n in read_headers(Path(path)) if n in allowed}
    if not fields:
        return
    try:
        for start, block in read_rows(path, fields, 0, num_rows(path), chunk):
            for name, column in block.items():
                bad = unused_value(column, allowed[name])
                if bad is not None:
                    raise ConfigError(unused_value_message(path, name, start + bad[0], bad[1], model.name,
                                                           allowed[name]))
    except ConfigError:
        raise
    except ValueError as exc:  # a value outside the field's dtype, text in a CSV: the same one line, now
        raise ConfigError(str(exc)) from None


# ----------------------------------------------------------------------------- writing
def id_range(n: int, rank: int, world: int) -> tuple[int, int]:
    """The agent ids ``[lo, hi)`` rank ``rank`` of ``world`` holds in id order: ``ceil(N / P)`` ids per rank."""
    per = -(-n // world)
    return min(n, rank * per), min(n, (rank + 1) * per)


def agents_by_id(engine) -> tuple[dict[str, torch.Tensor], int, int]:
    """This rank's share of every agent in id order: ids ``[lo, hi)`` with ``ceil(N / P)`` ids per rank.

    A copy: the engine's agents stay where they are. Call on all ranks. Returns (fields, lo, hi).
    """
    from multigpu.sim import exchange
    from multigpu.sim.state import AgentState

    rank, world, n = engine.rank, engine.world, engine.num_agents
    copy = AgentState(engine.state.schema, engine.state.n, engine.device)
    copy.append({k: engine.state[k] for k in copy.schema})
    if world > 1:
        dest = (copy["id"].to(torch.int64) // -(-n // world)).to(torch.int32)
        away = torch.nonzero(dest != rank).reshape(-1)
        exchange.migrate(copy, away, dest[away])
    fields = copy.sorted_by_id()
    lo, hi = id_range(n, rank, world)
    if fields["id"].numel() != hi - lo:
        raise RuntimeError(f"rank {rank} holds {fields['id'].numel()} agents of id range {lo}..{hi}")
    return fields, lo, hi


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def _slices_on_rank0(engine, fields: dict[str, torch.Tensor], name: str) -> Iterator[np.ndarray]:
    """On rank 0: field ``name`` of rank 0, 1, ... in turn (point-to-point from the others). Call on all ranks."""
    import torch.distributed as dist

    from multigpu.runtime.collectives import timed_collective

    mine = fields[name].contiguous().view(torch.uint8)
    if engine.rank != 0:
        with timed_collective("save_agents"):
            dist.send(mine, dst=0)
        return
    yield _numpy(fields[name])
    dtype = fields[name].dtype
    for r in range(1, engine.world):
        lo, hi = id_range(engine.num_agents, r, engine.world)
        # on the senders' device: a GPU tensor is sent over NCCL and must be received over NCCL
        buf = torch.empty((hi - lo) * fields[name].element_size(), dtype=torch.uint8, device=mine.device)
        with timed_collective("save_agents"):
            dist.recv(buf, src=r)
        yield _numpy(buf.view(dtype))


def _foreign(path: Path, fields: Mapping[str, torch.dtype]) -> str | None:
    """Why ``path`` holds something ``save`` did not write there (None: it is new or one of our agent tables).

    Ours: a folder of ``<field>.npy`` only, or an .npz / .parquet whose columns are fields of the model.
    Anything else (a file of another kind, a subfolder, a run directory) is the user's and is never replaced.
    """
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink():
        return "is a symbolic link"
    if _kind(path) == "npy":
        if not path.is_dir():
            return "is a file, not a folder of agent files"
        ours = {f"{name}.npy" for name in fields}
        other = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir()
                       if p.name not in ours or not p.is_file() or p.is_symlink())
        if other:
            shown = ", ".join(other[:4]) + (f" and {len(other) - 4} more" if len(other) > 4 else "")
            return f"holds files that are not agent files ({shown})"
        return None
    if path.is_dir():
        return "is a folder"
    try:
        unknown = sorted(set(read_headers(path)) - set(fields))
    except ConfigError:
        return f"holds something that is not a {path.suffix} agent table"
    return f"holds columns {unknown} that are not fields of the model" if unknown else None


def check_target(path: str | Path, fields: Mapping[str, torch.dtype]) -> None:
    """Refuse (ConfigError) a ``save_agents`` target that holds anything but agent files: ``save`` replaces it."""
    path = Path(path)
    why = _foreign(path, fields)
    if why is not None:
        ours = (f"a folder that --save-agents wrote (only {', '.join(f'{n}.npy' for n in fields)})"
                if _kind(path) == "npy" else f"a {path.suffix} file that --save-agents wrote")
        raise ConfigError(f"sim.save_agents {str(path)!r} {why}, so it is not replaced; valid: a new path, or {ours}")


def _temporary_beside(path: Path, folder: bool) -> Path:
    """A new, uniquely named temporary sibling of ``path`` (created empty; never an existing name)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix, suffix = f".{path.name}.", ".tmp"
    if folder:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=path.parent))
        fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    else:  # O_CREAT | O_EXCL | O_NOFOLLOW, a name no one can guess
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=suffix, dir=path.parent)
        tmp = Path(name)
    # what a plain mkdir / open under the user's own umask would have made (a rank runs under the launcher's 0077),
    # through the descriptor: a link put at that name meanwhile (the folder may be another user's) is not followed
    try:
        os.fchmod(fd, (0o777 if folder else 0o666) & ~user_umask())
    finally:
        os.close(fd)
    return tmp


def _remove_ours(tmp: Path | None, names: Iterable[str]) -> None:
    """Remove a temporary we made: only the files we put there, then the folder (left if anything else is in it)."""
    if tmp is None:
        return
    with contextlib.suppress(OSError):
        if tmp.is_dir() and not tmp.is_symlink():
            for name in names:
                (tmp / f"{name}.npy").unlink(missing_ok=True)
            tmp.rmdir()
        else:
            tmp.unlink(missing_ok=True)


def _replace(tmp: Path, path: Path, names: Iterable[str]) -> None:
    """Put the finished ``tmp`` at ``path``: a file over a file by one rename; an agent folder's files one by one,
    each by a rename of its own into ``path`` (:func:`multigpu.files.replace_files`), so that a reader of the
    folder finds each file whole and another writer of the same folder never leaves it without them (swapping the
    whole folder did both: a missing folder, then "Directory not empty"); then the emptied ``tmp`` goes."""
    if not tmp.is_dir():
        os.replace(tmp, path)
        return
    replace_files(tmp, [f"{name}.npy" for name in names], path)
    tmp.rmdir()


def save(engine, path: str | Path) -> Path:
    """Write the engine's agents, ordered by id, to ``path`` (.npz, .parquet, or a folder of .npy). Collective.

    Written into a new temporary sibling and renamed when complete. An existing ``path`` is replaced only
    when it is an agent table (see :func:`check_target`); anything else is refused on every rank.
    """
    from multigpu.runtime import collectives

    path = Path(path)
    kind = _kind(path) if path.suffix != ".csv" else "csv"
    if kind == "csv":
        raise ConfigError(f"sim.save_agents {str(path)!r}: CSV is read, not written; use .npz, .parquet or a folder")
    fields, lo, hi = agents_by_id(engine)
    barrier = collectives.barrier if engine.world > 1 else (lambda: None)
    tmp, refused = None, None
    if engine.rank == 0:
        try:
            check_target(path, engine.state.schema)
            tmp = _temporary_beside(path, folder=kind == "npy")
        except ConfigError as exc:
            refused = ("config", str(exc))
        except OSError as exc:
            refused = ("output", str(cannot_write(path, exc)))
    if engine.world > 1:  # every rank learns the verdict and where to write (the npy slices are written by all)
        tmp, refused = collectives.broadcast_object((tmp, refused))
    if refused is not None:
        raise (ConfigError if refused[0] == "config" else OutputError)(refused[1])
    try:
        _write(engine, kind, tmp, fields, lo, hi, barrier)
        barrier()
        if engine.rank == 0:
            check_target(path, engine.state.schema)  # once more: something may have appeared during the run
            _replace(tmp, path, fields)
            tmp = None
            user_made(path)  # the files in an npy folder too: written by ranks under the launcher's 0077
    except OSError as exc:
        raise cannot_write(path, exc) from exc
    finally:
        if engine.rank == 0:
            _remove_ours(tmp, fields)
    barrier()
    return path


def _write(engine, kind: str, tmp: Path, fields: dict[str, torch.Tensor], lo: int, hi: int, barrier) -> None:
    n = engine.num_agents
    if kind == "npy":  # every rank writes its own slice in place
        if engine.rank == 0:
            for name, t in fields.items():
                np.lib.format.open_memmap(tmp / f"{name}.npy", mode="w+", dtype=_numpy(t).dtype, shape=(n,)).flush()
        barrier()
        for name, t in fields.items():
            out = np.load(tmp / f"{name}.npy", mmap_mode="r+")
            out[lo:hi] = _numpy(t)
            out.flush()
            del out
    elif kind == "npz":
        zf = zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) if engine.rank == 0 else None
        for name, t in fields.items():
            member = zf.open(f"{name}.npy", "w", force_zip64=True) if zf is not None else None
            if member is not None:
                np.lib.format.write_array_header_2_0(member, {"descr": np.lib.format.dtype_to_descr(
                    _numpy(t).dtype), "fortran_order": False, "shape": (n,)})
            for part in _slices_on_rank0(engine, fields, name):
                member.write(part.tobytes())
            if member is not None:
                member.close()
        if zf is not None:
            zf.close()
    else:
        pa = import_pyarrow() if engine.rank == 0 else None
        writer = None
        parts = {name: _slices_on_rank0(engine, fields, name) for name in fields}
        for _ in range(engine.world):  # one row group per rank's slice
            table = {name: next(parts[name], None) for name in fields}
            if engine.rank == 0:
                t = pa.table({k: v for k, v in table.items()})
                writer = writer or pa.parquet.ParquetWriter(tmp, t.schema)
                writer.write_table(t)
        if writer is not None:
            writer.close()
