"""Arrays and volumes for ``multigpu infer``: ``.npy`` through numpy, NIfTI (``.nii``, ``.nii.gz``) through nibabel.

Used on both sides of the launch, through the hooks in ``io`` (where the format is
chosen by suffix): the launcher probes each file's header and checks it against
the data it holds (``probe``: no array is read), the ranks read (``read``) and
rank 0 writes (``write``, atomically).

Layout, as MONAI's ``NumpyReader`` and ``NibabelReader`` read by default (no
channel axis): every axis is spatial, one channel. A 2-D array ``(H, W)`` gets
2-D windows, a 3-D volume ``(D, H, W)`` (NIfTI: ``(X, Y, Z)``) 3-D windows.
NIfTI's trailing axes of size 1 are dropped (``(X, Y, 1)`` is 2-D).

Memory: a ``.npy`` file and an uncompressed ``.nii`` are memory-mapped
(copy-on-write, never written back); each rank's windows are cut from the map,
so a rank reads the pages its windows touch, not the whole file. Values are
kept as they are (no scaling to [0, 1]); integer and bool arrays stay mapped
and each window is cast to float32. Read whole into float32 instead (mapping
cannot help): float64/float16 or byte-swapped data, a ``.nii.gz`` (gzip cannot
be read from the middle) and a NIfTI with scl_slope/scl_inter scaling.

Outputs, in the input's format: ``.npy`` float32 with the input's shape (a
model with ``C > 1`` output channels: ``(C, *spatial)``, channel first); NIfTI
float32 with the input's header and affine (``C > 1``: channels on the last
axis, ``(X, Y, Z, C)`` or ``(X, Y, 1, C)``; a model that upsamples by ``k``
divides the voxel size by ``k``, keeping the volume where it was in space).
"""

from __future__ import annotations

import contextlib
import gzip
import math
import os
from pathlib import Path

import numpy as np
import torch

from multigpu.errors import ConfigError
from multigpu.files import atomic_path

__all__ = ["SUFFIXES", "handles", "output_path", "probe", "read", "write"]

NPY_SUFFIXES = (".npy",)
NIFTI_SUFFIXES = (".nii", ".nii.gz")
SUFFIXES = NPY_SUFFIXES + NIFTI_SUFFIXES
VALID_SHAPES = "valid: 2-D (H, W) or 3-D (D, H, W), one channel (NIfTI: (X, Y) or (X, Y, Z))"
_MAPPED = {np.dtype(t) for t in ("bool", "uint8", "uint16", "int8", "int16", "int32", "int64", "float32")}
"""dtypes read straight from the map (torch views them; the runner casts each window to float32)."""


def _suffix(path: Path) -> str | None:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def handles(path: str | os.PathLike) -> bool:
    """Whether ``path`` is read and written here (by its suffix)."""
    return _suffix(Path(path)) is not None


def _nibabel():
    try:
        import nibabel
    except ImportError:
        raise ConfigError("reading NIfTI volumes needs nibabel: pip install 'multigpu[image]' (or pip install "
                          "nibabel)") from None
    return nibabel


@contextlib.contextmanager
def _quiet_nibabel():
    """nibabel, with its own logger silenced for the block: on loading a header it fixes (a zero pixdim, say) it
    prints its own lines to stderr, before and beside ours."""
    nib = _nibabel()
    logger = nib.imageglobals.logger
    was = logger.disabled
    logger.disabled = True
    try:
        yield nib
    finally:
        logger.disabled = was


# ---- checking a file against its header (the launcher) --------------------------------------------------

def _check_array(path: Path, what: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    """The spatial size, or a one-line ConfigError for a dtype or a shape ``infer`` cannot take."""
    if dtype.hasobject:
        raise ConfigError(f"{what} '{path}' holds Python objects (dtype {dtype}), which cannot be read without "
                          "unpickling; valid: a numeric array (bool, int, uint, float)")
    if dtype.kind not in "biuf" or dtype.fields is not None:
        raise ConfigError(f"{what} '{path}' has dtype {dtype}; valid: a numeric array (bool, int, uint, float)")
    if len(shape) not in (2, 3) or 0 in shape:
        raise ConfigError(f"{what} '{path}' has shape {shape}; {VALID_SHAPES}")
    return shape


def _check_length(path: Path, what: str, have: int, want: int, header: str) -> None:
    if have != want:
        problem = "is truncated" if have < want else "does not match its header"
        raise ConfigError(f"{what} '{path}' {problem}: its header says {header} ({want:,} bytes of data) but the "
                          f"file holds {have:,}; valid: a complete file written by numpy/nibabel")


def _npy_header(path: Path) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    fmt = np.lib.format
    with open(path, "rb") as f:
        major, _ = fmt.read_magic(f)
        read_header = fmt.read_array_header_1_0 if major == 1 else fmt.read_array_header_2_0
        shape, fortran, dtype = read_header(f, max_header_size=1 << 20)
        return tuple(shape), fortran, dtype, f.tell()


def _probe_npy(path: Path) -> tuple[int, ...]:
    try:
        shape, _, dtype, offset = _npy_header(path)
    except Exception as exc:  # noqa: BLE001 - a bad magic string, header or version means the same to the user
        raise ConfigError(f"input '{path}' cannot be read as a .npy array: {exc}") from None
    size = _check_array(path, ".npy array", shape, dtype)
    _check_length(path, ".npy array", path.stat().st_size - offset, math.prod(shape) * dtype.itemsize,
                  f"shape {shape} {dtype}")
    return size


def _gzip_length(path: Path) -> int:
    """Bytes a gzip file holds once decompressed (streamed: the whole file is read, never held)."""
    total = 0
    with gzip.open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            total += len(chunk)
    return total


def _nifti_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """NIfTI's shape without trailing axes of size 1 beyond the second (``(X, Y, 1)`` is a 2-D image)."""
    while len(shape) > 2 and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def _refuse_bomb(path: Path, decoded: int, max_decode_ratio: float, floor: int) -> None:
    """One line for a compressed file that would decompress to more than ``max_decode_ratio`` times its size (and
    more than ``floor`` bytes; 0: no guard), as :mod:`multigpu.infer.io` refuses an image that would."""
    from multigpu.units import format_bytes

    stored = max(path.stat().st_size, 1)
    if not max_decode_ratio or decoded <= floor or decoded <= max_decode_ratio * stored:
        return
    raise ConfigError(f"input '{path}' would decompress to {format_bytes(decoded)} of voxels from a "
                      f"{format_bytes(stored)} file ({decoded / stored:,.0f}x its size, more than max_decode_ratio="
                      f"{max_decode_ratio:g}): a decompression bomb, or a volume of one flat value; valid: another "
                      "file, or max_decode_ratio=0 to read it anyway")


def _probe_nifti(path: Path, max_decode_ratio: float = 0.0, floor: int = 0) -> tuple[int, ...]:
    nib = _nibabel()
    try:
        with _quiet_nibabel():
            image = nib.load(path)
        header = image.header
        shape, dtype, offset = tuple(header.get_data_shape()), header.get_data_dtype(), int(image.dataobj.offset)
        if not isinstance(image, nib.Nifti1Image | nib.Nifti2Image):
            raise ValueError(f"it is a {type(image).__name__}, not a NIfTI-1/NIfTI-2 image")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - nibabel's header errors are many kinds; all mean "not readable"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"input '{path}' cannot be read as NIfTI: {first}") from None
    affine = np.asarray(image.affine, dtype=np.float64)
    if not np.isfinite(affine).all():  # the output is written with it: nibabel refuses, once every window is done
        row = int(np.argwhere(~np.isfinite(affine))[0][0])
        raise ConfigError(f"NIfTI '{path}' has an affine (its voxel-to-world matrix) that is not finite "
                          f"({affine[row][~np.isfinite(affine[row])][0]} in row {row}); valid: a NIfTI whose "
                          "qform/sform holds finite numbers (set them with nibabel or fslorient)")
    with nib.openers.ImageOpener(path) as f:  # as stored: nib.load quietly fixes a wrong bitpix in its copy
        bitpix = int(type(header).from_fileobj(f, check=False)["bitpix"])
    if dtype.kind in "biuf" and bitpix != dtype.itemsize * 8:
        raise ConfigError(f"NIfTI '{path}' does not match its header: bitpix {bitpix} for datatype "
                          f"{dtype} ({dtype.itemsize * 8} bits); valid: a file written by nibabel or a NIfTI tool")
    size = _check_array(path, "NIfTI", _nifti_shape(shape), dtype)
    if path.name.lower().endswith(".gz"):  # before a byte is decompressed: what the header says it holds
        _refuse_bomb(path, offset + math.prod(shape) * dtype.itemsize, max_decode_ratio, floor)
    try:
        stored = _gzip_length(path) if path.name.lower().endswith(".gz") else path.stat().st_size
    except (OSError, EOFError) as exc:  # a truncated or corrupt gzip stream
        raise ConfigError(f"NIfTI '{path}' is truncated or corrupt: {exc}") from None
    _check_length(path, "NIfTI", stored - offset, math.prod(shape) * dtype.itemsize, f"shape {shape} {dtype}")
    return size


def probe(path: str | os.PathLike, max_decode_ratio: float = 0.0, floor: int = 0) -> tuple[int, tuple[int, ...]]:
    """``(channels, spatial size)`` from the header, checked against the file's length; one line on any problem,
    and for a ``.nii.gz`` that would decompress to more than ``max_decode_ratio`` times its size (and ``floor``
    bytes: the decompression-bomb guard; 0: none), before it is decompressed."""
    path = Path(path)
    return 1, (_probe_npy(path) if _suffix(path) in NPY_SUFFIXES else _probe_nifti(path, max_decode_ratio, floor))


# ---- reading (every rank) ---------------------------------------------------------------------------------

def _as_tensor(array: np.ndarray) -> torch.Tensor:
    """``(1, 1, *spatial)``: a view of the map for the dtypes torch can view, else float32 read whole."""
    if array.dtype not in _MAPPED:  # float64/float16 or byte-swapped: a copy, as MONAI's loaders make
        array = np.asarray(array, dtype=np.float32)
    return torch.from_numpy(array)[None, None]  # a copy-on-write map ("c"): writable, yet never writes the file


def read(path: str | os.PathLike) -> torch.Tensor:
    """The array as ``(1, 1, *spatial)``; memory-mapped where the file allows (see the module docstring)."""
    path = Path(path)
    if _suffix(path) in NPY_SUFFIXES:
        array = np.load(path, mmap_mode="c", allow_pickle=False)
        _check_array(path, ".npy array", array.shape, array.dtype)
        return _as_tensor(array)
    with _quiet_nibabel() as nib:
        image = nib.load(path, mmap="c")
    # unscaled: a memmap for .nii (Fortran order: torch views its strides); scaled values are computed: read whole
    unscaled = (image.dataobj.slope, image.dataobj.inter) == (1.0, 0.0)
    array = np.asanyarray(image.dataobj) if unscaled else image.get_fdata(dtype=np.float32)
    shape = _nifti_shape(array.shape)
    return _as_tensor(array.reshape(shape, order="A") if shape != array.shape else array)


# ---- writing (rank 0) -------------------------------------------------------------------------------------

def output_path(output_dir: str | os.PathLike, input_path: str | os.PathLike) -> Path:
    """Same name and format as the input, in ``output_dir``."""
    src = Path(input_path)
    suffix = _suffix(src)
    return Path(output_dir) / f"{src.name[: len(src.name) - len(suffix)]}{suffix}"


def _spatial_ndim(source: Path) -> int:
    """Spatial dims of the input, from its header alone."""
    if _suffix(source) in NPY_SUFFIXES:
        return len(_npy_header(source)[0])
    with _quiet_nibabel() as nib:
        return len(_nifti_shape(tuple(nib.load(source).shape)))


def write(path: str | os.PathLike, image: torch.Tensor, source: str | os.PathLike) -> None:
    """Write ``(C, *spatial)`` (or ``(1, C, *spatial)``), the output for ``source``, in its format, atomically."""
    path, source = Path(path), Path(source)
    if image.dim() == _spatial_ndim(source) + 2:
        image = image[0]
    array = image.detach().float().cpu().numpy()
    if _suffix(path) in NPY_SUFFIXES:
        array = array[0] if array.shape[0] == 1 else array  # one channel: the input's layout (H, W) / (D, H, W)
        with atomic_path(path, keep_suffix=True) as tmp, open(tmp, "wb") as f:
            np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        return
    _write_nifti(path, array, source)


def _write_nifti(path: Path, array: np.ndarray, source: Path) -> None:
    with _quiet_nibabel() as nib:
        src = nib.load(source)
        shape = tuple(src.shape)
        spatial = array.shape[1:]
        scale = [o // i for o, i in zip(spatial, _nifti_shape(shape), strict=True)]
        if array.shape[0] == 1:  # the input's own shape, trailing 1s included, scaled
            data = array[0].reshape([s * (scale[d] if d < len(scale) else 1) for d, s in enumerate(shape)])
        else:  # channels last; a 2-D image keeps a third axis of size 1 so that channels are the 4th
            data = np.moveaxis(array, 0, -1)
            if len(spatial) == 2:
                data = data[:, :, None, :]
        header = src.header.copy()
        header.set_data_dtype(np.float32)
        header["cal_min"], header["cal_max"] = 0, 0  # the input's display range says nothing of the output
        affine = src.affine.copy()
        if any(k != 1 for k in scale):
            k = np.array((scale + [1, 1])[:3], dtype=float)
            # voxels k times smaller along each axis; the first voxel's centre moves so the volume's corner stays put
            affine[:3, 3] += affine[:3, :3] @ ((1 / k - 1) / 2)
            affine[:3, :3] = affine[:3, :3] / k
        out = type(src)(np.ascontiguousarray(data, dtype=np.float32), affine, header)  # sets qform/sform/zooms if moved
        out.header.set_slope_inter(1.0, 0.0)
        blob = out.to_bytes()
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        if path.name.lower().endswith(".gz"):
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0, filename="") as gz:  # mtime 0: the same bytes each run
                gz.write(blob)
        else:
            f.write(blob)
