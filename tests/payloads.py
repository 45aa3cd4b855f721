"""Crafted pickles for the untrusted-file tests: their payload creates a marker file, nothing else.

The payload is a standard-library call (``pathlib.Path.touch``), so it runs in
any process that unpickles it with plain ``pickle``, as ``torch.load(...,
weights_only=False)`` and DCP's ``.metadata`` reader do: a test that finds no
marker has shown that nothing unpickled the file, not merely that an import
failed.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
from pathlib import Path

import torch


class TouchOnLoad:
    """Unpickling this calls ``Path(marker).touch()``: proof that a load ran code from the file."""

    def __init__(self, marker: str | Path):
        self.marker = Path(marker)

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _manifest(directory: Path, files: dict, meta: dict | None = None) -> None:
    (directory / "manifest.json").write_text(json.dumps({"format": 2, "step": 4, "world_size": 1, "time": "",
                                                         "meta": meta or {}, "files": files}))


def _entry(body: bytes) -> dict:
    return {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}


def evil_checkpoint(directory: Path, marker: Path, *, listed: bool = False) -> Path:
    """A checkpoint folder whose ``state.pt`` (a ``torch.save`` file shaped like training's) holds the payload.

    ``listed``: a forged ``manifest.json`` records its true size and SHA-256 (someone who wrote the whole
    folder); else the folder has no manifest (a hand-made folder, or a save killed before its manifest).
    """
    directory.mkdir(parents=True, exist_ok=True)
    torch.save({"model": {"w": TouchOnLoad(marker)}, "optimizer": {}, "rng": []}, directory / "state.pt")
    if listed:
        _manifest(directory, {"state.pt": _entry((directory / "state.pt").read_bytes())})
    return directory


def evil_sim_checkpoint(directory: Path, marker: Path, *, checksum: str = "forged") -> Path:
    """A simulation checkpoint folder whose DCP ``.metadata`` is the payload.

    ``checksum``: "forged" records the evil file's true SHA-256 in manifest.json (someone who wrote
    the whole folder), "stale" keeps a different one (a known run's .metadata replaced), "none"
    records none (a hand-made folder).
    """
    directory.mkdir(parents=True, exist_ok=True)
    body = pickle.dumps(TouchOnLoad(marker))
    (directory / ".metadata").write_bytes(body)
    meta = {"step": 4, "num_agents": 1000, "model": "sir", "seed": 0, "grid": [64, 64], "params": {},
            "env": {}, "history": {}, "rebalances": [], "world_size": 1}
    files = {}
    if checksum != "none":
        files[".metadata"] = _entry(body if checksum == "forged" else b"what was written")
        files[".metadata"]["bytes"] = len(body)
    _manifest(directory, files, meta)
    return directory


def png_bomb(path: Path, side: int = 12000) -> Path:
    """A flat black RGB PNG of ``side`` x ``side`` (12000: 432 MB of pixels in about 450 KB; such a
    file once passed the memory check and was OOM-killed). Made in milliseconds, never holding the image: one row
    is deflated with a full flush (so the block stands alone) and repeated; the Adler-32 of n zero bytes is
    ``(n mod 65521) << 16 | 1``."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + 3 * side)  # filter byte 0, then black pixels
    raw = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = raw.compress(row) + raw.flush(zlib.Z_FULL_FLUSH)
    stream = b"\x78\xda" + block * side + raw.flush() + struct.pack(">I", (len(row) * side % 65521) << 16 | 1)
    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)  # 8-bit RGB
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", stream) + chunk(b"IEND", b""))
    return path


def nifti_gz_bomb(path: Path, shape: tuple[int, int, int] = (512, 512, 320)) -> Path:
    """A ``.nii.gz`` float32 volume of zeros, ``shape`` (the default: 320 MiB of voxels in about 330 KB), made in
    well under a second without holding it: nibabel writes the header of an uncompressed file, and the voxels are one
    deflated MiB of zeros with a full flush (so the block stands alone) repeated, in a gzip member whose CRC-32 is
    extended by ``zlib.crc32`` over the same MiB. (A 1.3 MB one once decoded to 4.8 GB in every rank.)"""
    import gzip
    import io
    import struct
    import zlib

    import nibabel as nib
    import numpy as np

    header = nib.Nifti1Header()
    header.set_data_shape(shape)
    header.set_data_dtype(np.float32)
    head = io.BytesIO()
    header.write_to(head)
    head.write(b"\0" * (int(header["vox_offset"]) - head.tell()))  # up to the voxels (352: the extension flag)
    prefix, data_bytes, mib = head.getvalue(), math.prod(shape) * 4, 1 << 20
    assert data_bytes % mib == 0
    raw = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = raw.compress(prefix) + raw.flush(zlib.Z_FULL_FLUSH)
    block = raw.compress(b"\0" * mib) + raw.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(prefix)
    zeros = b"\0" * mib
    for _ in range(data_bytes // mib):
        crc = zlib.crc32(zeros, crc)
    total = len(prefix) + data_bytes
    body = first + block * (data_bytes // mib) + raw.flush()
    gz = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + body + struct.pack("<II", crc, total & 0xFFFFFFFF)
    path.write_bytes(gz)
    with gzip.open(path, "rb") as f:  # a valid stream: its first bytes are the header
        assert f.read(len(prefix)) == prefix
    return path
