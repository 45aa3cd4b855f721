"""Training data in the formats users have, as data factories for ``multigpu train`` (inside each rank).

A data factory returns ``(train_dataset, val_dataset | None)``; these ship:

* ``multigpu.train.data:stdlib_text`` (the default): character-level text of the
  Python standard library's source, which every machine has, so ``multigpu train``
  needs no download;
* ``multigpu.train.data:token_files``: nanoGPT's ``train.bin`` / ``val.bin``
  (uint16 or uint32 token ids), memory-mapped, never read whole;
* ``multigpu.train.data:bytes_file``: any file as byte-level tokens (vocabulary 256), memory-mapped;
* ``multigpu.train.hf:saved_dataset``: a Hugging Face ``datasets`` dataset saved to disk.

Every one yields windows of ``block_size + 1`` tokens as ``(x, y)``, ``y`` shifted
by one; ``mg.TrainSampler`` visits them in a random order each epoch.

The standard-library corpus: files are read in sorted path order up to ``max_chars``; the
last ``val_percent`` of that text is validation (nanoGPT's split), so the split
is the same on every rank, every run and every machine with the same files. The vocabulary is fixed: tab, newline and printable ASCII, plus one
"unknown" symbol for everything else, so a checkpoint never depends on which
files were read.
"""

from __future__ import annotations

import fnmatch
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from multigpu.errors import ConfigError
from multigpu.factory import checked_by
from multigpu.train.config import require

__all__ = ["VOCAB", "CharDataset", "DataConfig", "TextData", "TokenWindows", "bytes_file", "decode", "encode", "find_files",
           "load_text", "stdlib_text", "token_files"]

@dataclass(frozen=True, kw_only=True, slots=True)
class DataConfig:
    """Character-level text: by default the Python standard library's own source files."""

    path: str | None = None
    """A folder (searched recursively for ``pattern``) or one text file; None = the stdlib's folder."""
    pattern: str = "*.py"
    """File name pattern inside a folder."""
    max_chars: int = 2_000_000
    """Read files (in sorted order) until this many characters; 0 = no limit."""
    val_percent: float = 10.0
    """The last this-many percent of the text is held out for validation."""

    def __post_init__(self) -> None:
        require(self.max_chars >= 0, f"data.kwargs.max_chars={self.max_chars} must be >= 0")
        require(0.0 < self.val_percent < 100.0, f"data.kwargs.val_percent={self.val_percent} must be in (0, 100)")


VOCAB = "\t\n" + "".join(chr(c) for c in range(32, 127)) + "\u2047"
"""The symbols; the last one (⁇) stands for any character outside the others."""
_UNKNOWN = len(VOCAB) - 1
_TABLE = np.full(128, _UNKNOWN, dtype=np.uint8)  # code point (< 128) -> token id
for _i, _ch in enumerate(VOCAB[:-1]):
    _TABLE[ord(_ch)] = _i
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def encode(text: str) -> torch.Tensor:
    """Text -> uint8 token ids."""
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.where(points < 128, _TABLE[np.minimum(points, 127)], _UNKNOWN).astype(np.uint8)
    return torch.from_numpy(ids)


def decode(ids) -> str:
    """Token ids -> text."""
    return "".join(VOCAB[int(i)] for i in ids)


def _root(cfg: DataConfig) -> Path:
    return Path(cfg.path).expanduser() if cfg.path else Path(sysconfig.get_paths()["stdlib"])


def find_files(cfg: DataConfig, *, first_only: bool = False) -> tuple[Path, list[Path]]:
    """The root and its matching files in sorted order; a clear error when there are none.

    ``first_only``: stop at the first match (the launcher's check needs only to know there is one;
    walking the whole standard library there cost a quarter of a second on every launch).
    """
    root = _root(cfg)
    if root.is_file():
        return root.parent, [root]
    if not root.is_dir():
        raise ConfigError(f"data.kwargs.path '{root}' does not exist; valid: a folder of {cfg.pattern} files, "
                          "a text file, or null for the Python standard library")
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in fnmatch.filter(names, cfg.pattern)]
        if first_only and files:
            break
    files.sort()
    if not files:
        raise ConfigError(f"data.kwargs.path '{root}' has no {cfg.pattern} files; give a folder that holds some "
                          "(data.kwargs.pattern=... to match others), or a text file")
    return root, files


@dataclass
class TextData:
    """Encoded train and validation text (uint8 tensors) and the files they came from."""

    train: torch.Tensor
    val: torch.Tensor
    num_files: int


def load_text(cfg: DataConfig, min_chars: int = 0) -> TextData:
    """Read, split and encode the corpus. Both parts must hold at least ``min_chars`` characters."""
    root, files = find_files(cfg)
    texts: list[str] = []
    total = 0
    for path in files:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        total += len(texts[-1])
        if cfg.max_chars and total >= cfg.max_chars:
            break
    text = "".join(texts)[: cfg.max_chars or None]
    cut = int(len(text) * (1 - cfg.val_percent / 100))  # the tail is validation (nanoGPT's split)
    train, val = encode(text[:cut]), encode(text[cut:])
    for name, t in (("train", train), ("validation", val)):
        if len(t) < min_chars:
            raise ConfigError(f"data under '{root}' gives {len(t)} {name} characters, fewer than the {min_chars} "
                              "one batch needs; raise data.kwargs.max_chars or point data.kwargs.path at more text")
    return TextData(train, val, len(texts))


class CharDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` characters: ``(x, y)`` with ``y`` shifted by one."""

    vocab_size = len(VOCAB)
    encode = staticmethod(encode)
    decode = staticmethod(decode)

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens = tokens
        self.block_size = block_size
        self.num = max((len(tokens) - 1) // block_size, 0)

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def _check_stdlib_text(block_size: int = 128, path: str | None = None, pattern: str = "*.py",
                       max_chars: int = 2_000_000, val_percent: float = 10.0) -> None:
    find_files(DataConfig(path=path, pattern=pattern, max_chars=max_chars, val_percent=val_percent), first_only=True)


@checked_by(_check_stdlib_text)
def stdlib_text(block_size: int = 128, path: str | None = None, pattern: str = "*.py", max_chars: int = 2_000_000,
                val_percent: float = 10.0) -> tuple[CharDataset, CharDataset]:
    """Character-level text (the standard library's source, or ``path``): train and validation windows."""
    cfg = DataConfig(path=path, pattern=pattern, max_chars=max_chars, val_percent=val_percent)
    text = load_text(cfg, min_chars=block_size + 1)
    print_main(f"data: {text.num_files} files, {len(text.train):,} train / {len(text.val):,} validation characters")
    return CharDataset(text.train, block_size), CharDataset(text.val, block_size)


def print_main(line: str) -> None:
    """Print on rank 0 only."""
    from multigpu.runtime import group

    if group.rank() == 0:
        print(line, flush=True)


class TokenWindows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` token ids of a flat binary file, memory-mapped.

    The file is opened lazily in each process (DataLoader workers included), and only the
    windows read are paged in, so a file of any size costs no memory up front.
    """

    def __init__(self, path: str | Path, block_size: int, dtype: str = "uint16", vocab_size: int | None = None,
                 start: int = 0, stop: int | None = None):
        self.path, self.block_size, self.dtype = str(path), block_size, np.dtype(dtype)
        size = os.path.getsize(self.path) // self.dtype.itemsize
        self.start, self.stop = start, size if stop is None else stop
        self.num = max((self.stop - self.start - 1) // block_size, 0)
        self._data: np.memmap | None = None
        self.vocab_size = vocab_size

    def _tokens(self) -> np.memmap:
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._data

    def max_token(self) -> int:
        """The largest token id in this part (reads it once, in chunks)."""
        data, top = self._tokens(), 0
        for lo in range(self.start, self.stop, 1 << 24):
            top = max(top, int(data[lo : min(lo + (1 << 24), self.stop)].max(initial=0)))
        return top

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo = self.start + i * self.block_size
        chunk = torch.from_numpy(self._tokens()[lo : lo + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_data": None}  # each process maps the file itself


_TOKEN_DTYPES = ("uint16", "uint32")


def _check_ids(part: TokenWindows | None, vocab: int, given: int | None) -> None:
    """Every id of ``part`` is below ``vocab`` (one line naming the file, the id and what is valid)."""
    if part is None:
        return
    top = part.max_token()
    if top >= vocab:
        source = "data.kwargs.vocab_size" if given else "the largest id in train.bin plus one"
        raise ConfigError(f"{part.path} holds token id {top:,} but the vocabulary has {vocab:,} ids ({source}); "
                          f"valid: ids below {vocab:,}, or data.kwargs.vocab_size={top + 1} or more")


_SCAN_IN_LAUNCHER = 256 << 20
"""Token files up to this size are scanned for out-of-vocabulary ids in the launcher (a fraction of a second);
larger ones on the ranks, which read the vocabulary from train.bin anyway."""


def _check_token_files(path: str, block_size: int = 128, dtype: str = "uint16", vocab_size: int | None = None) -> None:
    folder = Path(path)
    if dtype not in _TOKEN_DTYPES:
        raise ConfigError(f"data.kwargs.dtype={dtype!r} is invalid; valid: {', '.join(_TOKEN_DTYPES)}")
    if not (folder / "train.bin").is_file():
        raise ConfigError(f"data.kwargs.path '{folder}' has no train.bin; valid: a folder with nanoGPT's "
                          "train.bin (and val.bin) of token ids")
    size = np.dtype(dtype).itemsize
    parts = [folder / n for n in ("train.bin", "val.bin") if (folder / n).is_file()]
    for part in parts:
        if part.stat().st_size % size:
            other = {"uint16": "uint32", "uint32": "uint16"}[dtype]
            raise ConfigError(f"{part} is {part.stat().st_size:,} bytes, not a whole number of {dtype} token ids "
                              f"({size} bytes each): cut short, or written as another type; valid: a complete "
                              f"file of {dtype} ids, or data.kwargs.dtype={other} if it was written so")
    if sum(p.stat().st_size for p in parts) <= _SCAN_IN_LAUNCHER:
        train = TokenWindows(parts[0], block_size, dtype)
        val = TokenWindows(folder / "val.bin", block_size, dtype) if len(parts) > 1 else None
        vocab = vocab_size or train.max_token() + 1
        for part in (train, val) if vocab_size else (val,):
            _check_ids(part, vocab, vocab_size)
    tokens = (folder / "train.bin").stat().st_size // size
    if tokens < block_size + 1:
        raise ConfigError(f"{folder / 'train.bin'} holds {tokens} tokens, fewer than one window of "
                          f"block_size + 1 = {block_size + 1}")


@checked_by(_check_token_files)
def token_files(path: str, block_size: int = 128, dtype: str = "uint16",
                vocab_size: int | None = None) -> tuple[TokenWindows, TokenWindows | None]:
    """nanoGPT's token files: ``<path>/train.bin`` and, if present, ``<path>/val.bin`` (flat ``dtype`` ids).

    ``vocab_size`` defaults to the largest id in ``train.bin`` plus one (a scan of the file: pass it to skip that).
    """
    folder = Path(path)
    train = TokenWindows(folder / "train.bin", block_size, dtype)
    val = TokenWindows(folder / "val.bin", block_size, dtype) if (folder / "val.bin").is_file() else None
    vocab = vocab_size or train.max_token() + 1
    _check_ids(val, vocab, vocab_size)  # an id past the vocabulary would be an IndexError deep in the model
    for part in (train, val):
        if part is not None:
            part.vocab_size = vocab
    print_main(f"data: {folder}: {train.stop:,} train tokens" + (f", {val.stop:,} validation" if val else "")
               + f" ({dtype}, vocabulary {vocab:,})")
    return train, val


class ByteWindows(TokenWindows):
    """:class:`TokenWindows` over a file's bytes (vocabulary 256)."""

    vocab_size = 256

    def __init__(self, path: str | Path, block_size: int, start: int = 0, stop: int | None = None):
        super().__init__(path, block_size, "uint8", 256, start, stop)

    @staticmethod
    def encode(text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.uint8)

    @staticmethod
    def decode(ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def _check_bytes_file(path: str, block_size: int = 128, val_percent: float = 10.0) -> None:
    if not Path(path).is_file():
        raise ConfigError(f"data.kwargs.path '{path}' is not a file; valid: a text (or any) file, read as bytes")
    if not 0 < val_percent < 100:
        raise ConfigError(f"data.kwargs.val_percent={val_percent} must be in (0, 100)")
    size = Path(path).stat().st_size
    if size * min(val_percent, 100 - val_percent) / 100 < block_size + 1:
        raise ConfigError(f"'{path}' ({size:,} bytes) is too small for one train and one validation window of "
                          f"block_size + 1 = {block_size + 1} bytes")


@checked_by(_check_bytes_file)
def bytes_file(path: str, block_size: int = 128, val_percent: float = 10.0) -> tuple[ByteWindows, ByteWindows]:
    """Any file as byte-level tokens; the last ``val_percent`` of it is validation."""
    size = os.path.getsize(path)
    cut = int(size * (1 - val_percent / 100))
    print_main(f"data: {path}: {cut:,} train / {size - cut:,} validation bytes")
    return ByteWindows(path, block_size, 0, cut), ByteWindows(path, block_size, cut, size)
