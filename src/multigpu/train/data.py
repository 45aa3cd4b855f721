"""Character-level text data: the Python standard library's source, split into train/val (inside each rank).

Every machine with Python has this corpus, so ``multigpu train`` needs no
download. Files are read in sorted path order up to ``data.max_chars``; the
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
from multigpu.train.nano import DataConfig

__all__ = ["CharDataset", "TextData", "VOCAB", "decode", "encode", "find_files", "load_text"]

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


def find_files(cfg: DataConfig) -> tuple[Path, list[Path]]:
    """The root and its matching files in sorted order; a clear error when there are none."""
    root = _root(cfg)
    if root.is_file():
        return root.parent, [root]
    if not root.is_dir():
        raise ConfigError(f"data.path '{root}' does not exist; valid: a folder of {cfg.pattern} files, "
                          "a text file, or null for the Python standard library")
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in fnmatch.filter(names, cfg.pattern)]
    files.sort()
    if not files:
        raise ConfigError(f"data.path '{root}' has no {cfg.pattern} files; give a folder that holds some "
                          "(data.pattern=... to match others), or a text file")
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
                              "one batch needs; raise data.max_chars or point data.path at more text")
    return TextData(train, val, len(texts))


class CharDataset(Dataset):
    """Non-overlapping windows of ``block_size + 1`` characters: ``(x, y)`` with ``y`` shifted by one."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens = tokens
        self.block_size = block_size
        self.num = max((len(tokens) - 1) // block_size, 0)

    def __len__(self) -> int:
        return self.num

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1].long()
        return chunk[:-1], chunk[1:]
