"""An ensemble's folder: the manifest, one file per finished replicate, the tables and the plot (rank 0).

    <run_dir>/ensemble/
        manifest.json                  the design: points, seed rule, series; written once, at the start
        checksums.jsonl                every replicate file's size and SHA-256, a line each, written before the file
        replicates/p000003/r000017.csv replicate 17 of point 3: step and every series (written whole, atomically)
        bands.csv   (.parquet)         per point, series, step: replicates, mean, sd, ci_low, ci_high, q_low,
                                       median, q_high (the tidy table; Parquet where pyarrow is installed)
        finals.csv  (.parquet)         the same figures of the final values
        replicates.csv (.parquet)      per replicate: its seed, and per series its final value and peak
        bands.png                      the mean of every series with its band, per point
        summary.json                   replicates per point, whether the bands are as narrow as asked, timings

A replicate's file appears whole or not at all (written beside, then renamed),
so the replicates an ensemble has are the files present: they are its state.
A killed ensemble keeps every replicate it finished, and continuing it runs
only the others. What a continued ensemble trusts is checked as a checkpoint's files are: every replicate file must
match the size and SHA-256 recorded for it in ``checksums.jsonl`` (a file changed since, by a digit, is refused
naming it); an ensemble of another run is continued from copies made in this run's folder (this run's files,
checked against those checksums as they are copied), never from links to its files. What a run continues
(``--resume auto``, ``--resume PATH`` or a restarted worker group) is decided by
:func:`multigpu.sim.ensemble_resume.continued` (the rule every run resumes by, over ensemble folders), and
:meth:`ReplicateStore.open` reads it. Nothing holds every series
in memory: the running figures are one mean and variance per point; the
tables are made one point at a time.
"""

from __future__ import annotations

import csv
import errno
import io
import re
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from multigpu.errors import ConfigError
from multigpu.files import Temporary, append_line, atomic_path, read_jsonl, write_json_atomic
from multigpu.sim.bands import Bands, point_bands
from multigpu.sim.design import Point
from multigpu.sim.ensemble_resume import FOLDER, check_design, is_ensemble

__all__ = ["FOLDER", "ReplicateStore", "check_folder", "plot_bands", "read_replicate"]

FORMAT = 2
"""2: every replicate file has its size and SHA-256 in ``checksums.jsonl``. An ensemble written in format 1 (before
there were checksums) is continued with its files checked for shape only."""
CHECKSUMS = "checksums.jsonl"
_FILE = re.compile(r"^r(\d{6,})\.csv$")
_LEFT = re.compile(r"^\.r\d{6,}\.csv\.(tmp\d+|[0-9a-f]{12}\.tmp)$")
"""A replicate being written when the ensemble was killed: the temporary folder of its write (files.Temporary), or
the file an earlier version wrote beside it."""


def _point_dir(root: Path, p: int) -> Path:
    return root / "replicates" / f"p{p:06d}"


def read_replicate(path: str | Path) -> tuple[list[str], np.ndarray]:
    """One replicate's file: (series names, values [steps, series] as float64; the step column left out)."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    names = rows[0][1:]
    try:
        values = np.array([[float(v) for v in row[1:]] for row in rows[1:]], dtype=np.float64).reshape(-1, len(names))
    except ValueError:
        line, bad = next(((i + 2, v) for i, row in enumerate(rows[1:]) for v in row[1:] if not _is_number(v)),
                         (None, None))
        what = f"line {line} holds {bad!r}, not a number" if line else "a row has more or fewer values than its columns"
        raise ConfigError(f"replicate file {path} {what}; valid: delete that file (its replicate runs again, with the "
                          "same seed) and resume again") from None
    return names, values


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _whole(path: Path, names: Sequence[str], rows: int) -> str | None:
    """Why ``path`` is not a whole replicate with the series ``names`` and ``rows`` steps (None: it is)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        return f"it cannot be read: {exc.__class__.__name__}"
    return _whole_text(data, names, rows)


def _whole_text(data: bytes, names: Sequence[str], rows: int) -> str | None:
    """Why ``data`` is not a whole replicate file (see :func:`_whole`)."""
    try:
        text = data.decode("utf-8")
    except UnicodeError as exc:
        return f"it cannot be read: {exc.__class__.__name__}"
    if not text.endswith("\n"):
        return "it is cut short: its last line has no end" if text else "it is empty"
    lines = text[:-1].split("\n")
    header = ",".join(["step", *names])
    if lines[0] != header:
        return f"its columns are {lines[0][:60]!r}, this ensemble's are {header[:60]!r}"
    if len(lines) - 1 != rows:
        return f"it has {len(lines) - 1} steps, this ensemble's replicates have {rows}"
    if text.count(",") != len(lines) * len(names):  # counted, not parsed: an ensemble may hold many files
        return "a row has more or fewer values than its columns"
    return None


def _sha256(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def _checksum_line(p: int, r: int, data: bytes) -> str:
    import json

    return json.dumps({"point": p, "replicate": r, "bytes": len(data), "sha256": _sha256(data)})


def checksums(folder: str | Path) -> dict[tuple[int, int], dict[str, Any]] | None:
    """What ``folder/checksums.jsonl`` records per (point, replicate) (the last line of each wins: a replicate run
    again writes its line again); None for an ensemble of format 1, which records none."""
    import json

    folder = Path(folder)
    try:
        fmt = json.loads((folder / "manifest.json").read_text(encoding="utf-8")).get("format", 1)
    except (OSError, ValueError, AttributeError):
        fmt = FORMAT
    if fmt == 1:
        return None
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for line in read_jsonl(folder / CHECKSUMS):
        key = (line.get("point"), line.get("replicate"))
        if all(isinstance(k, int) for k in key) and isinstance(line.get("sha256"), str):
            out[key] = line
    return out


def _unchanged(data: bytes, recorded: dict[tuple[int, int], dict[str, Any]] | None, p: int, r: int,
               log: Path) -> str | None:
    """Why ``data`` (a replicate file's bytes) is not the replicate written as (p, r) (None: it is, or nothing is
    recorded in a format-1 ensemble)."""
    if recorded is None:
        return None
    entry = recorded.get((p, r))
    if entry is None:
        return f"{log} records no checksum for it (it was not written by this ensemble)"
    if entry.get("bytes") != len(data) or entry["sha256"] != _sha256(data):
        return (f"it does not match its checksum in {log} ({len(data):,} bytes, recorded {entry.get('bytes')}): it "
                "was changed after it was written")
    return None


def check_folder(folder: str | Path, shapes: Sequence[tuple[Sequence[str], int]], most: int | None = None
                 ) -> dict[int, list[int]]:
    """The replicates of the ensemble folder ``folder`` that a run continues, per point, once every one of them is
    checked: each file as written (its size and SHA-256 those ``checksums.jsonl`` records), whole (its last line
    ended; the columns of ``shapes[p]``, the point's series names; as
    many rows as its steps; as many values as columns), no point the design does not have, and (``most``: the
    replicates asked per point) none beyond what this run asks for, whose results would be mixed into the
    bands. A half-written file a kill left is not a replicate (:meth:`ReplicateStore.open` removes it).

    Raises:
        ConfigError: one line naming the first file (or point) that cannot be continued, and what to do.
    """
    folder = Path(folder)
    found: dict[int, list[int]] = {}
    recorded = checksums(folder)
    points = folder / "replicates"
    entries = sorted(points.iterdir()) if points.is_dir() else []
    for entry in entries:
        m = re.fullmatch(r"p(\d{6,})", entry.name)
        if not entry.is_dir() or m is None or int(m.group(1)) >= len(shapes):
            raise ConfigError(f"--resume: {entry} is not a point of this ensemble (it has {len(shapes)}, "
                              f"p000000..p{len(shapes) - 1:06d}); valid: the settings that made {folder}, or a "
                              "new --run-dir")
        p = int(m.group(1))
        names, rows = shapes[p]
        done = []
        for file in sorted(entry.iterdir()):
            if (f := _FILE.match(file.name)) is None:
                continue
            why = _whole(file, names, rows)
            if why is not None:
                raise ConfigError(f"--resume: {file} is not a whole replicate of this ensemble ({why}); valid: "
                                  "delete that file (its replicate runs again, with the same seed) and resume "
                                  "again, or a new --run-dir")
            changed = _as_written(file, p, int(f.group(1)), recorded, folder / CHECKSUMS)
            if changed is not None:
                raise ConfigError(f"--resume: {file} is not the replicate this ensemble wrote ({changed}); valid: "
                                  "delete that file (its replicate runs again, with the same seed) and resume "
                                  "again, or a new --run-dir")
            done.append(int(f.group(1)))
        if most is not None and done and done[-1] >= most:
            raise ConfigError(f"--resume: the ensemble in {folder} holds {done[-1] + 1} replicates of point {p} "
                              f"and sim.ensemble.replicates is {most} here: the bands would mix in replicates "
                              f"this run does not ask for; valid: --replicates {done[-1] + 1} or more (leave it "
                              "out: the run's own count), or a new --run-dir")
        found[p] = done
    return found


def _as_written(file: Path, p: int, r: int, recorded, log: Path) -> str | None:
    try:
        data = file.read_bytes()
    except OSError as exc:
        return f"it cannot be read: {exc.__class__.__name__}"
    return _unchanged(data, recorded, p, r, log)


def check_no_orphans(folder: str | Path) -> None:
    """A folder that holds replicate files but no manifest (lost, or never an ensemble's) is not started over:
    one-line ConfigError."""
    folder = Path(folder)
    if any(_FILE.match(f.name) for f in folder.glob("replicates/p*/*")):
        raise ConfigError(f"{folder} holds replicate files but no readable manifest.json (what ensemble they are "
                          "of is not known, so they are neither continued nor overwritten); valid: a new "
                          "--run-dir, or move that folder away")


def _format(v: Any) -> str:
    if v is None:
        return ""
    return repr(v) if isinstance(v, float) else str(v)


class ReplicateStore:
    """Rank 0's side of an ensemble folder (or, with ``root`` None, the same in memory: nothing written)."""

    def __init__(self, root: Path | None, manifest: dict[str, Any]):
        self.root = root
        self.manifest = manifest
        self._memory: dict[tuple[int, int], dict[str, list]] = {}

    def open(self, source: Path | None = None, shapes: Sequence[tuple[Sequence[str], int]] | None = None,
             most: int | None = None) -> dict[int, list[int]]:
        """Start the folder, or continue an ensemble: ``source`` (the run's ``resume_from``) None: a new one,
        its manifest written first (a folder that holds an ensemble already is refused: continue it, or use
        another); this folder: continue it; another run's ensemble folder: its replicates are brought here
        first (copies, each checked; the manifest last, so that a kill meanwhile leaves a folder that is not
        continued yet) and that folder is left as it is. A continued ensemble must be of the same design
        (:func:`multigpu.sim.ensemble_resume.check_design`) and its files
        whole (:func:`check_folder`, with ``shapes`` and ``most``; a one-line ConfigError, never a start from
        zero over them). Returns the replicates there per point; a file a kill left half-written is removed."""
        if self.root is None:
            return {}
        if source is None:
            if (self.root / "manifest.json").exists():
                raise ConfigError(f"{self.root} holds an ensemble already; valid: continue it (--resume auto, or "
                                  "resume='auto' from Python), or another run directory")
            check_no_orphans(self.root)
            write_json_atomic(self.root / "manifest.json", {"format": FORMAT, **self.manifest})
            return {}
        if not is_ensemble(source):
            raise ConfigError(f"--resume: {source} is not an ensemble folder (an {FOLDER}/ folder with a manifest.json: "
                              "a checkpoint is not continued by an ensemble); valid: an ensemble folder, or a new run "
                              "directory")
        check_design(source, self.manifest)
        if shapes is not None:
            check_folder(source, shapes, most)
        if Path(source).resolve() != self.root.resolve():
            self._bring(Path(source), shapes)
        for left in (self.root / "replicates").glob("p*/.r*"):
            if _LEFT.match(left.name):
                if left.is_dir() and not left.is_symlink():
                    shutil.rmtree(left, ignore_errors=True)
                else:
                    left.unlink(missing_ok=True)
        return {p["index"]: self.replicates(p["index"]) for p in self.manifest["points"]}

    def _bring(self, source: Path, shapes: Sequence[tuple[Sequence[str], int]] | None) -> None:
        """Another run's replicates into this folder, then the manifest. Each file is copied (never linked: the other
        run's owner could rewrite a shared file in place later), its copy read back and checked against the
        checksum the other run recorded for it (a format-1 ensemble records none: the copy is checked for the
        shape of a whole replicate instead), and recorded with this run's checksums; the copies are this run's
        files (its owner, the mode it writes replicates with). One-line ConfigError naming a file that does not
        match; nothing is half-copied."""
        recorded = checksums(source)
        log = source / CHECKSUMS
        for p in self.manifest["points"]:
            there, here = _point_dir(source, p["index"]), _point_dir(self.root, p["index"])
            names = sorted(e.name for e in there.iterdir() if _FILE.match(e.name)) if there.is_dir() else []
            if names:
                here.mkdir(parents=True, exist_ok=True)
            for name in names:
                if (here / name).exists():
                    continue
                r = int(_FILE.match(name).group(1))
                data = (there / name).read_bytes()
                why = _unchanged(data, recorded, p["index"], r, log)
                if why is None and recorded is None and shapes is not None:
                    why = _whole_text(data, *shapes[p["index"]])
                if why is not None:
                    raise ConfigError(f"--resume: {there / name} cannot be continued ({why}); nothing of it was "
                                      "copied; valid: ask that run's owner to delete that file (its replicate runs "
                                      "again, with the same seed), or a new --run-dir")
                self._write_bytes(p["index"], r, data)
        write_json_atomic(self.root / "manifest.json", {"format": FORMAT, **self.manifest})

    def _write_bytes(self, p: int, r: int, data: bytes) -> None:
        """Replicate ``r`` of point ``p`` as ``data``: its checksum line first (a kill between the two leaves a line
        without a file, a replicate that runs again), then the file, whole or not at all, read back before it is put
        in place (what lands is what was checked)."""
        append_line(self.root / CHECKSUMS, _checksum_line(p, r, data))
        path = _point_dir(self.root, p) / f"r{r:06d}.csv"
        with atomic_path(path) as tmp:
            tmp.write_bytes(data)
            if tmp.read_bytes() != data:
                raise OSError(errno.EIO, f"the copy of {path} does not read back as written")

    def replicates(self, p: int) -> list[int]:
        """The finished replicates of point ``p``, in order."""
        if self.root is None:
            return sorted(r for q, r in self._memory if q == p)
        folder = _point_dir(self.root, p)
        try:
            names = [e.name for e in folder.iterdir()]
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _FILE.match(n)))

    def write(self, p: int, r: int, series: dict[str, list]) -> None:
        """Replicate ``r`` of point ``p`` (a ``step`` column and the series), whole or not at all."""
        if self.root is None:
            self._memory[(p, r)] = series
            return
        names = list(series)
        buf = io.StringIO()
        buf.write(",".join(names) + "\n")
        for row in zip(*(series[n] for n in names), strict=True):
            buf.write(",".join(_format(v) for v in row) + "\n")
        self._write_bytes(p, r, buf.getvalue().encode())

    def read(self, p: int, r: int) -> np.ndarray:
        """Replicate ``r`` of point ``p`` as [steps, series] float64 (the step column left out)."""
        if self.root is None:
            s = self._memory[(p, r)]
            return np.array([s[n] for n in s if n != "step"], dtype=np.float64).T.reshape(len(s["step"]), -1)
        return read_replicate(_point_dir(self.root, p) / f"r{r:06d}.csv")[1]

    def iter_point(self, p: int, upto: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
        for r in self.replicates(p):
            if upto is None or r < upto:
                yield r, self.read(p, r)


# ----------------------------------------------------------------------------- tables
class _Table:
    """A tidy table written a point at a time: CSV, and Parquet (one row group per point) where pyarrow is.
    Each file is written beside its name and renamed at :meth:`close`: a reader never sees half a table."""

    def __init__(self, root: Path, name: str, columns: list[str]):
        self.columns = columns
        self.paths = {"csv": root / f"{name}.csv"}
        try:
            import pyarrow  # noqa: F401
            import pyarrow.parquet  # noqa: F401

            self.paths["parquet"] = root / f"{name}.parquet"
        except ImportError:
            pass
        root.mkdir(parents=True, exist_ok=True)
        self.tmp: dict[str, Temporary] = {}
        try:
            for k, p in self.paths.items():  # each in a folder of its own: no name to plant a link at
                self.tmp[k] = Temporary(p)
            self._fh = open(self.tmp["csv"].path, "w", newline="")  # noqa: SIM115 - closed by close()
        except BaseException:
            for t in self.tmp.values():
                t.discard()
            raise
        self._writer = csv.writer(self._fh)
        self._writer.writerow(columns)
        self._pq = None

    def add(self, rows: list[list[Any]]) -> None:
        self._writer.writerows([_format(v) for v in row] for row in rows)
        if "parquet" not in self.paths or not rows:
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pa.table({c: [row[i] for row in rows] for i, c in enumerate(self.columns)})
        if self._pq is None:
            self._pq = pq.ParquetWriter(str(self.tmp["parquet"].path), table.schema)
        self._pq.write_table(table.cast(self._pq.schema))

    def close(self, ok: bool) -> list[Path]:
        """Rename the finished files into place (``ok``), or remove them; returns the paths written."""
        self._fh.close()
        if self._pq is not None:
            self._pq.close()
        done = []
        try:
            for k, path in self.paths.items():
                tmp = self.tmp[k]
                if ok and tmp.path.exists():
                    tmp.commit()
                    done.append(path)
        finally:
            for tmp in self.tmp.values():
                tmp.discard()
        return done


def _num(v: float) -> float | None:
    return None if v != v else float(v)  # NaN (no band yet) -> empty


def write_tables(root: Path, points: Sequence[Point], names: Sequence[Sequence[str]], store: ReplicateStore,
                 level: float, quantiles: tuple[float, float], seeds) -> tuple[list[Bands], list[Path]]:
    """bands, finals and replicates tables from the stored replicates, one point at a time; returns each
    point's figures (means and bands, for the plot) and the paths written."""
    keys = list(dict.fromkeys(k for p in points for k in p.values))
    figures = ["replicates", "mean", "sd", "ci_low", "ci_high", "q_low", "median", "q_high"]
    bands_t = _Table(root, "bands", ["point", *keys, "series", "step", *figures])
    finals_t = _Table(root, "finals", ["point", *keys, "series", *figures])
    reps_t = _Table(root, "replicates", ["point", *keys, "replicate", "seed", "series", "final", "peak", "peak_step"])
    out = []
    try:
        for point, series in zip(points, names, strict=True):
            head = [point.index, *(point.values.get(k) for k in keys)]
            reps = list(store.iter_point(point.index))
            b = point_bands((v for _, v in reps), level, quantiles)
            out.append(b)
            rows, finals, per = [], [], []
            steps = b.mean.shape[0] if b.n else 0
            for j, name in enumerate(series):
                for t in range(steps):
                    rows.append([*head, name, t + 1, b.n, *(_num(a[t, j]) for a in (b.mean, b.sd, b.low, b.high,
                                                                                   b.q_low, b.median, b.q_high))])
                if steps:
                    finals.append([*head, name, b.n, *(_num(a[-1, j]) for a in (b.mean, b.sd, b.low, b.high,
                                                                                b.q_low, b.median, b.q_high))])
                for r, v in reps:
                    if v.shape[0]:
                        peak = int(np.argmax(v[:, j]))
                        per.append([*head, r, seeds(point.index, r), name, _num(v[-1, j]), _num(v[peak, j]), peak + 1])
            bands_t.add(rows)
            finals_t.add(finals)
            reps_t.add(per)
    except BaseException:
        for t in (bands_t, finals_t, reps_t):
            t.close(False)
        raise
    paths = [p for t in (bands_t, finals_t, reps_t) for p in t.close(True)]
    return out, paths


# ----------------------------------------------------------------------------- plot
def bands_figure(points: Sequence[Point], names: Sequence[Sequence[str]], bands: Sequence[Bands], level: float,
                 title: str):
    """Per series a panel: every point's mean (a thin line), its band of the mean (filled above the line, with its
    edges drawn above and under it, so a band narrower than the line still shows) and the spread of its replicates
    (lighter). The axis starts at step 0, the start; the series are recorded after each step (1, 2, ...)."""
    import matplotlib.pyplot as plt

    series = list(dict.fromkeys(n for ns in names for n in ns))
    shown = series[:6]
    cols = min(3, len(shown)) or 1
    rows = -(-len(shown) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    colours = plt.get_cmap("viridis" if len(points) > 10 else "tab10")
    for k, name in enumerate(shown):
        ax = axes[k // cols][k % cols]
        for i, (point, ns, b) in enumerate(zip(points, names, bands, strict=True)):
            if name not in ns or not b.n:
                continue
            j = list(ns).index(name)
            steps = np.arange(1, b.mean.shape[0] + 1)
            colour = colours(i / max(1, len(points) - 1)) if len(points) > 10 else colours(i % 10)
            ax.plot(steps, b.mean[:, j], color=colour, lw=1.0, zorder=2,
                    label=f"{point.label} (n={b.n})" if len(points) <= 10 else None)
            if b.q_low is not None:
                ax.fill_between(steps, b.q_low[:, j], b.q_high[:, j], color=colour, alpha=0.12, lw=0, zorder=1)
            if b.n > 1:
                ax.fill_between(steps, b.low[:, j], b.high[:, j], color=colour, alpha=0.4, lw=0, zorder=3)
                for edge in (b.low[:, j], b.high[:, j]):
                    ax.plot(steps, edge, color=colour, lw=0.6, alpha=0.9, zorder=3)
        ax.set_xlim(left=0)
        ax.set_title(name)
        ax.set_xlabel("step")
        if k == 0 and len(points) <= 10:
            ax.legend(fontsize=7)
    for k in range(len(shown), rows * cols):
        axes[k // cols][k % cols].axis("off")
    fig.suptitle(f"{title}\nmean, {level:.0%} band of the mean (dark), spread of the replicates (light)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_bands(path: Path, points: Sequence[Point], names: Sequence[Sequence[str]], bands: Sequence[Bands],
               level: float, title: str) -> Path | None:
    """Per series a panel (:func:`bands_figure`), saved to ``path``; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("multigpu sim: no plot written; install matplotlib (pip install 'multigpu[report]')")
        return None
    fig = bands_figure(points, names, bands, level, title)
    with atomic_path(path, keep_suffix=True) as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    return path
