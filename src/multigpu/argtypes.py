"""argparse value types shared by the command line and the workloads' shortcut flags (launcher side)."""

from __future__ import annotations

import argparse

__all__ = ["non_negative_int", "parse_window", "positive_float", "positive_int"]


def _whole_number(text: str, minimum: int) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text} is invalid; valid: a whole number >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    return _whole_number(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: a whole number >= 0."""
    return _whole_number(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is invalid; valid: a number > 0")
    return value


def parse_window(text: str) -> tuple[int, int, int]:
    """``"wait,warmup,active"`` -> three whole numbers (active >= 1)."""
    from multigpu.errors import ConfigError

    parts = [p.strip() for p in text.split(",")]
    try:
        wait, warmup, active = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(
            f"--profile-steps {text!r} is invalid; valid: three whole numbers wait,warmup,active such as 1,1,3"
        ) from None
    if wait < 0 or warmup < 0 or active < 1:
        raise ConfigError(f"--profile-steps {text!r} is invalid; valid: wait >= 0, warmup >= 0, active >= 1")
    return wait, warmup, active
