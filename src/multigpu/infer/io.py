"""Reading and writing images for ``multigpu infer``: PNG/JPEG through Pillow, TIFF through tifffile.

Used on both sides of the launch: the launcher probes headers (``probe``, no
pixel decoding) to reject bad input before anything starts; the ranks read
(``read_image``) and rank 0 writes (``write_image``, atomically). Both libraries
are optional (``pip install 'multigpu[image]'``) and imported only here.
``.npy`` arrays and NIfTI volumes are handed to ``formats`` (the hooks below).

Pixel values: 8- and 16-bit images become float32 in [0, 1]; float TIFFs are
kept as they are. Outputs go back as the input's kind: PNG (8-bit, clipped to
[0, 1]; JPEG inputs are written as PNG) or TIFF (float32, unclipped).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from multigpu.errors import ConfigError
from multigpu.files import atomic_path
from multigpu.infer import formats

__all__ = ["IMAGE_SUFFIXES", "ImageInfo", "output_path", "probe", "read_image", "write_image"]

PILLOW_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
TIFF_SUFFIXES = (".tif", ".tiff")
IMAGE_SUFFIXES = PILLOW_SUFFIXES + TIFF_SUFFIXES
_PIL_CHANNELS = {"1": 1, "L": 1, "I": 1, "I;16": 1, "I;16B": 1, "I;16L": 1, "F": 1, "LA": 2, "RGB": 3, "RGBA": 4}


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ConfigError("reading PNG/JPEG images needs Pillow: pip install 'multigpu[image]' (or pip install pillow)") from None
    Image.MAX_IMAGE_PIXELS = None  # our inputs are large on purpose (16k x 16k and more)
    return Image


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


def probe(path: str | os.PathLike) -> ImageInfo:
    """Channels and size of an image from its header, with a one-line error for a missing or unreadable file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"input '{path}' does not exist")
    if formats.handles(path):
        return ImageInfo(str(path), *formats.probe(path))
    kind = _kind(path)
    try:
        if kind == "pil":
            with _pil().open(path) as im:
                channels = _PIL_CHANNELS.get(im.mode, 3)
                return ImageInfo(str(path), channels, (im.height, im.width))
        with _tifffile().TiffFile(path) as tif:
            channels, size = _tiff_layout(tuple(tif.series[0].shape), path)
            return ImageInfo(str(path), channels, tuple(size))
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoder error means the same to the user
        raise ConfigError(f"input '{path}' cannot be read as an image: {exc}") from None


def _to_float(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.uint8:
        return array.astype(np.float32) / 255.0
    if array.dtype == np.uint16:
        return array.astype(np.float32) / 65535.0
    if array.dtype == bool:
        return array.astype(np.float32)
    return array.astype(np.float32, copy=False)


def read_image(path: str | os.PathLike) -> torch.Tensor:
    """The image as a float32 tensor ``(1, C, H, W)`` (arrays and volumes: see ``formats.read``)."""
    path = Path(path)
    if formats.handles(path):
        return formats.read(path)
    if _kind(path) == "pil":
        with _pil().open(path) as im:
            if im.mode not in _PIL_CHANNELS:
                im = im.convert("RGBA" if "A" in im.getbands() else "RGB")
            array = np.asarray(im)
    else:
        array = _tifffile().imread(path)
        _tiff_layout(array.shape, path)
    if array.ndim == 2:
        array = array[:, :, None]
    return torch.from_numpy(np.ascontiguousarray(_to_float(array).transpose(2, 0, 1)))[None]


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
