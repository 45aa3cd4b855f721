"""Reading and writing images for ``multigpu infer``: PNG/JPEG through Pillow, TIFF through tifffile.

Used on both sides of the launch: the launcher probes headers (``probe``, no
pixel decoding) to reject bad input before anything starts; the ranks read
(``read_image``) and rank 0 writes (``write_image``, atomically). Both libraries
are optional (``pip install 'multigpu[image]'``) and imported only here.
``.npy`` arrays and NIfTI volumes are handed to ``formats`` (the hooks below).

Pixel values: 8- and 16-bit images become float32 in [0, 1]; float TIFFs are
kept as they are. Outputs go back as the input's kind: PNG (8-bit, clipped to
[0, 1]; JPEG inputs are written as PNG) or TIFF (float32, unclipped).

Memory: reading holds the decoded array and the float32 result at once, no more
(:meth:`ImageInfo.read_bytes`, measured; the launcher counts it). Decompression
bombs: an image that would decode to more than :data:`MAX_DECODE_RATIO` times its
file's size (and more than :data:`BOMB_FLOOR_BYTES`) is refused from its header;
``max_decode_ratio=0`` turns the guard off. Pillow's own pixel cap is lifted only
around our own reads (inputs are large on purpose), never for the whole process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from multigpu.errors import ConfigError
from multigpu.files import atomic_path
from multigpu.infer import formats

__all__ = ["BOMB_FLOOR_BYTES", "IMAGE_SUFFIXES", "MAX_DECODE_RATIO", "READ_FIXED_BYTES", "ImageInfo", "output_path",
           "probe", "read_image", "write_image"]

MAX_DECODE_RATIO = 100.0
"""Most times a file may grow when decoded. Photographs and scans compress 2-10x, TIFF float data less;
a crafted PNG or a deflated TIFF of one flat colour reaches about 1000x (12000x12000 RGB from 420 KB)."""
READ_FIXED_BYTES = 6 << 20
"""What a read costs whatever the image's size (the decoder's code and buffers: see ImageInfo.read_bytes)."""

BOMB_FLOOR_BYTES = 256 << 20
"""Images that decode to less than this are never called bombs, however well they compress."""

PILLOW_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
TIFF_SUFFIXES = (".tif", ".tiff")
IMAGE_SUFFIXES = PILLOW_SUFFIXES + TIFF_SUFFIXES
_PIL_CHANNELS = {"1": 1, "L": 1, "I": 1, "I;16": 1, "I;16B": 1, "I;16L": 1, "F": 1, "LA": 2, "RGB": 3, "RGBA": 4}


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("reading PNG/JPEG images needs Pillow: pip install 'multigpu[image]' (or pip install pillow)") from None
    return Image


@contextlib.contextmanager
def _no_pixel_cap(image) -> Iterator[None]:
    """Lift Pillow's pixel cap for one open (our inputs are large on purpose; our guard is the decode ratio)."""
    before = image.MAX_IMAGE_PIXELS
    image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        image.MAX_IMAGE_PIXELS = before


def _tifffile():
    try:
        import tifffile
    except ImportError:
        raise ConfigError("reading TIFF images needs tifffile: pip install 'multigpu[image]' (or pip install tifffile)") from None
    return tifffile


@dataclass(frozen=True)
class ImageInfo:
    path: str
    channels: int
    size: tuple[int, ...]
    """Spatial size (H, W)."""
    sample_bytes: int = 1
    """Bytes per channel of a pixel as decoded (1 for 8-bit, 2 for 16-bit, 4 for 32-bit and float)."""
    file_bytes: int | None = None

    @property
    def pixels(self) -> int:
        return self.size[0] * self.size[1]

    @property
    def decoded_bytes(self) -> int:
        return self.pixels * self.channels * self.sample_bytes

    def read_bytes(self) -> int:
        """Peak memory of :func:`read_image` for this image: the decoded array beside the float32 result, plus
        the decoder's fixed cost.

        Measured (peak RSS, ``VmHWM``; tests/unit/test_infer_io.py): 15 B/px for RGB, 20 for RGBA, 5 for grey, 6
        for 16-bit grey, plus, on a process's first read, what Pillow and zlib page in of their code and buffers
        whatever the size (1.2 to 4.3 MB, depending on the machine). Pillow's own buffer and ``tobytes`` come
        before the result and stay below it. Counted with :data:`READ_FIXED_BYTES` and 1/4 B/px to spare.
        The old read (``astype``, then ``/ 255``, then a transposed copy) peaked at 31 B/px for RGB where the
        launcher counted 12.
        """
        c, s = self.channels, self.sample_bytes
        pillow = 4 if c >= 3 else c * s  # Pillow keeps RGB and RGBA as 4 bytes a pixel
        return self.pixels * max(c * (4 + s), pillow + 2 * c * s) + self.pixels // 4 + READ_FIXED_BYTES


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in PILLOW_SUFFIXES:
        return "pil"
    if suffix in TIFF_SUFFIXES:
        return "tiff"
    raise ConfigError(f"input '{path}' has an unsupported type '{suffix or '(none)'}'; valid: "
                      f"{', '.join(IMAGE_SUFFIXES + formats.SUFFIXES)}")


def _tiff_layout(shape: tuple[int, ...], path: Path) -> tuple[int, tuple[int, ...]]:
    if len(shape) == 2:
        return 1, shape
    if len(shape) == 3 and shape[-1] <= 4:
        return shape[-1], shape[:2]
    raise ConfigError(f"TIFF '{path}' has shape {shape}; valid: (H, W) or (H, W, C) with C <= 4")


_PIL_SAMPLE_BYTES = {"I": 4, "F": 4, "I;16": 2, "I;16B": 2, "I;16L": 2}


def probe(path: str | os.PathLike, max_decode_ratio: float = MAX_DECODE_RATIO) -> ImageInfo:
    """Channels and size of an image from its header, with a one-line error for a missing or unreadable file,
    or one that would decode to more than ``max_decode_ratio`` times its size (0: no limit)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"input '{path}' does not exist")
    if formats.handles(path):  # a .nii.gz is held to the same guard (an uncompressed file holds what it says)
        return ImageInfo(str(path), *formats.probe(path, max_decode_ratio, BOMB_FLOOR_BYTES))
    kind = _kind(path)
    try:
        if kind == "pil":
            image = _pil()
            with _no_pixel_cap(image), image.open(path) as im:
                channels = _PIL_CHANNELS.get(im.mode, 3)
                info = ImageInfo(str(path), channels, (im.height, im.width), _PIL_SAMPLE_BYTES.get(im.mode, 1),
                                 path.stat().st_size)
                _refuse_bomb(info, max_decode_ratio)  # before anything reads further than the header
                _refuse_cut(im, path)
        else:
            with _tifffile().TiffFile(path) as tif:
                series = tif.series[0]
                channels, size = _tiff_layout(tuple(series.shape), path)
                info = ImageInfo(str(path), channels, tuple(size), series.dtype.itemsize, path.stat().st_size)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder error means the same to the user
        raise ConfigError(f"input '{path}' cannot be read as an image: {exc}") from None
    _refuse_bomb(info, max_decode_ratio)
    return info


def _refuse_cut(im, path: Path) -> None:
    """Refuse a PNG or JPEG whose file is cut short (a copy that stopped half-way), cheaply: a PNG's chunks are
    read and their checksums checked without decompressing them; a JPEG is decoded at 1/8 of its size (libjpeg's
    DCT scaling reads all of its data for 1/64 of the pixels)."""
    try:
        if im.format == "PNG":
            im.verify()
        elif im.format == "JPEG":
            im.draft(im.mode, (max(1, im.width // 8), max(1, im.height // 8)))
            im.load()
    except Exception as exc:  # noqa: BLE001 - Pillow says "Truncated File Read", "image file is truncated", ...
        raise ConfigError(f"input '{path}' is cut short or damaged ({exc}); valid: a complete {im.format} file "
                          "(copy or write it again)") from None


def _refuse_bomb(info: ImageInfo, max_decode_ratio: float) -> None:
    from multigpu.units import format_bytes

    decoded, stored = info.decoded_bytes, max(info.file_bytes or 0, 1)
    if not max_decode_ratio or decoded <= BOMB_FLOOR_BYTES or decoded <= max_decode_ratio * stored:
        return
    raise ConfigError(
        f"input '{info.path}' is {info.size[0]}x{info.size[1]} and would decode to {format_bytes(decoded)} from a "
        f"{format_bytes(stored)} file ({decoded / stored:,.0f}x its size, more than max_decode_ratio="
        f"{max_decode_ratio:g}): a decompression bomb, or an image of one flat colour; valid: another image, or "
        "max_decode_ratio=0 to read it anyway")


def _to_float(array: np.ndarray) -> np.ndarray:
    """``(H, W, C)`` of any dtype -> float32 ``(C, H, W)`` in one new array (no full-size temporaries)."""
    out = np.empty((array.shape[2], *array.shape[:2]), dtype=np.float32)
    chw = array.transpose(2, 0, 1)
    scale = {np.dtype(np.uint8): 255.0, np.dtype(np.uint16): 65535.0}.get(array.dtype)
    if scale is None:
        np.copyto(out, chw, casting="unsafe")  # bool, float and 32-bit ints as they are
    else:  # float32(x) / float32(scale) element by element: the same bits as astype(float32) / scale
        np.divide(chw, scale, out=out, dtype=np.float32, casting="unsafe")
    return out


def _pil_array(path: Path) -> np.ndarray:
    image = _pil()
    with _no_pixel_cap(image), image.open(path) as im:
        if im.mode not in _PIL_CHANNELS:
            im = im.convert("RGBA" if "A" in im.getbands() else "RGB")
        return np.asarray(im)  # Pillow's own buffer goes with ``im`` on return, before the float copy exists


def read_image(path: str | os.PathLike, max_decode_ratio: float = MAX_DECODE_RATIO) -> torch.Tensor:
    """The image as a float32 tensor ``(1, C, H, W)`` (a decompression bomb refused first, as in :func:`probe`;
    arrays and volumes: see ``formats.read``)."""
    path = Path(path)
    if formats.handles(path):
        return formats.read(path)
    probe(path, max_decode_ratio)
    if _kind(path) == "pil":
        array = _pil_array(path)
    else:
        array = _tifffile().imread(path)
        _tiff_layout(array.shape, path)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(_to_float(array))[None]


def output_path(output_dir: str | os.PathLike, input_path: str | os.PathLike) -> Path:
    """Where the output of ``input_path`` goes: same stem, PNG for Pillow inputs, TIFF for TIFF."""
    src = Path(input_path)
    if formats.handles(src):
        return formats.output_path(output_dir, src)
    suffix = ".tif" if src.suffix.lower() in TIFF_SUFFIXES else ".png"
    return Path(output_dir) / f"{src.stem}{suffix}"


def write_image(path: str | os.PathLike, image: torch.Tensor, source: str | os.PathLike | None = None) -> None:
    """Write ``(C, H, W)`` (or ``(1, C, H, W)``) atomically: temporary file, then rename. ``source``: the input
    it came from (arrays and volumes are written in its format: see ``formats.write``)."""
    path = Path(path)
    if source is not None and formats.handles(source):
        return formats.write(path, image, source)
    if image.dim() == 4:
        image = image[0]
    array = image.detach().float().cpu().numpy().transpose(1, 2, 0)
    if path.suffix.lower() not in TIFF_SUFFIXES and array.shape[2] not in (1, 3, 4):
        raise ConfigError(f"cannot write {array.shape[2]} channels as PNG ({path}); use a TIFF input/output instead")
    with atomic_path(path, keep_suffix=True) as tmp:
        if path.suffix.lower() in TIFF_SUFFIXES:
            _tifffile().imwrite(tmp, np.ascontiguousarray(array[:, :, 0] if array.shape[2] == 1 else array))
        else:
            pixels = np.clip(np.rint(np.clip(array, 0.0, 1.0) * 255.0), 0, 255).astype(np.uint8)
            _pil().fromarray(pixels[:, :, 0] if array.shape[2] == 1 else pixels).save(tmp)
