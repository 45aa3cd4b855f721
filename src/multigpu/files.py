"""Atomic file writes: readers see the old file or the whole new one, never half (both sides of the launch).

Standard library only. Every output multigpu writes (summaries, CSVs, plots,
images, reports, checkpoints) goes through :func:`atomic_path`: a temporary
file beside the target, renamed over it once complete, removed if writing fails.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "write_json_atomic", "write_text_atomic"]


@contextlib.contextmanager
def atomic_path(path: str | Path, *, keep_suffix: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success rename it over ``path``, on error remove it.

    Args:
        path: The file to write (its folder is created).
        keep_suffix: End the temporary name with ``path``'s suffix, for writers that pick the
            format from it (``savefig``, image libraries): ``.x.tmp<pid>.png`` instead of ``.x.png.tmp<pid>``.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = f".{path.stem}.tmp{os.getpid()}{path.suffix}" if keep_suffix else f".{path.name}.tmp{os.getpid()}"
    tmp = path.with_name(name)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` atomically (numbers torch or NumPy hand back become floats)."""
    return write_text_atomic(path, json.dumps(data, indent=2, default=float))
