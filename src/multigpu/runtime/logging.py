"""Rank-aware logging: a ``[multigpu rank 1/4]`` prefix, ``rank_zero_only``, ``warn_once`` (inside each rank)."""

from __future__ import annotations

import functools
import logging as _logging
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["get_logger", "rank_zero_only", "warn_once"]

F = TypeVar("F", bound=Callable[..., Any])
_WARNED: set[str] = set()


class _StderrHandler(_logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is when a record is emitted, not as it was when the logger was
    first built (a redirected or captured stderr, as under pytest, otherwise misses the warnings)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


class _RankFilter(_logging.Filter):
    def filter(self, record: _logging.LogRecord) -> bool:
        from multigpu.runtime import group

        record.rank_prefix = f"[multigpu rank {group.rank()}/{group.world_size()}]"
        return True


def get_logger(name: str = "multigpu") -> _logging.Logger:
    """A logger whose lines carry this rank, e.g. ``[multigpu rank 1/4] INFO: ...``."""
    logger = _logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
        handler = _StderrHandler()
        handler.setFormatter(_logging.Formatter("%(rank_prefix)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(_logging.INFO)
        logger.propagate = False
    return logger


def rank_zero_only(fn: F) -> F:
    """Run ``fn`` on rank 0 only; other ranks get ``None``. Not a collective: no rank waits."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from multigpu.runtime import group

        return fn(*args, **kwargs) if group.rank() == 0 else None

    return wrapper  # type: ignore[return-value]


def warn_once(message: str, category: type[Warning] = UserWarning) -> None:
    """Warn with ``message`` once per process (e.g. a setting silently ignored on this path)."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, category, stacklevel=2)
