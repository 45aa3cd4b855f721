"""SLURM's host-list grammar, read the way ``scontrol show hostnames`` reads it (pure; launcher and ranks).

A host list is expressions separated by commas (or blanks) outside brackets; an expression is text with
any number of bracket groups, each a comma-separated list of numbers and ``lo-hi`` ranges::

    gpu[01-03,7],login1        -> gpu01 gpu02 gpu03 gpu7 login1
    gpu[1-2]-ib                -> gpu1-ib gpu2-ib                  (text after a group)
    rack[1-2]-n[01-02]         -> rack1-n01 rack1-n02 rack2-n01 rack2-n02   (the first group varies slowest)
    n[008-010]                 -> n008 n009 n010                   (the width of ``lo`` pads every number)

A range is never expanded to find its first host or to count it (``n[0-999999999]`` is a billion hosts, and
the launcher needs one of them): :func:`first_host` and :func:`count_hosts` work on the parsed form, and
:func:`iter_hosts` expands lazily. Bad text (an unclosed or empty group, ``node[5-3]``, ``node[a-b]``,
non-ASCII digits) is one :class:`~multigpu.errors.ConfigError` line naming the variable it came from.

Written here rather than taken from ``python-hostlist`` (the maintained parser) because that package is
GPL-licensed and expands whole ranges (it refuses large ones instead of giving their first host).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

from multigpu.errors import ConfigError

__all__ = ["HostList", "count_hosts", "first_host", "iter_hosts", "parse_hostlist"]

_SEPARATORS = ", \t\n"
_DIGITS = frozenset("0123456789")


@dataclass(frozen=True)
class _Range:
    lo: int
    hi: int
    width: int

    def size(self) -> int:
        """How many numbers it holds (a Python int: ``len()`` cannot count past 2**63)."""
        return self.hi - self.lo + 1

    def text(self, i: int) -> str:
        return f"{self.lo + i:0{self.width}d}"


Part = str | tuple[_Range, ...]
"""Plain text, or one bracket group: its ranges in order."""


@dataclass(frozen=True)
class HostList:
    """A parsed host list: expressions, each a sequence of text and bracket groups."""

    expressions: tuple[tuple[Part, ...], ...]

    def size(self) -> int:
        """How many host names it holds (:func:`count_hosts`)."""
        return count_hosts(self)


def _fail(variable: str, text: str, why: str) -> ConfigError:
    return ConfigError(f"{variable}={text!r} is not a SLURM host list: {why}; valid: host names and bracket ranges "
                       "such as node[01-04,7],login1 or rack[1-2]-n[01-02]")


def _group(body: str, variable: str, text: str) -> tuple[_Range, ...]:
    if not body:
        raise _fail(variable, text, "an empty [] group")
    ranges = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        hi = hi if sep else lo
        if not lo or not hi or not set(lo) <= _DIGITS or not set(hi) <= _DIGITS:
            raise _fail(variable, text, f"[{body}] holds {item!r}, which is not a number or a lo-hi range of "
                                        "ASCII digits")
        if int(hi) < int(lo):
            raise _fail(variable, text, f"the range {item} runs backwards")
        ranges.append(_Range(int(lo), int(hi), len(lo)))
    return tuple(ranges)


def parse_hostlist(text: str, variable: str = "SLURM_JOB_NODELIST") -> HostList:
    """Parse ``text`` (from ``variable``, named in errors). An empty list has no expressions.

    Raises:
        ConfigError: one line naming ``variable`` and what is wrong.
    """
    expressions: list[tuple[Part, ...]] = []
    parts: list[Part] = []
    plain = ""
    i = 0
    while i <= len(text):
        ch = text[i] if i < len(text) else ","
        if ch == "[":
            end = text.find("]", i + 1)
            nested = text.find("[", i + 1)
            if end < 0:
                raise _fail(variable, text, f"the '[' at position {i + 1} is never closed")
            if 0 <= nested < end:
                raise _fail(variable, text, "brackets inside brackets")
            if plain:
                parts.append(plain)
                plain = ""
            parts.append(_group(text[i + 1:end], variable, text))
            i = end + 1
            continue
        if ch == "]":
            raise _fail(variable, text, f"a ']' at position {i + 1} closes no '['")
        if ch in _SEPARATORS:
            if plain:
                parts.append(plain)
                plain = ""
            if parts:
                expressions.append(tuple(parts))
                parts = []
        else:
            plain += ch
        i += 1
    return HostList(tuple(expressions))


def _expand(expression: tuple[Part, ...], k: int = 0, prefix: str = "") -> Iterator[str]:
    """The expression's hosts, the first group varying slowest, one at a time (no range is materialised)."""
    if k == len(expression):
        yield prefix
        return
    part = expression[k]
    if isinstance(part, str):
        yield from _expand(expression, k + 1, prefix + part)
        return
    for r in part:
        for i in range(r.size()):
            yield from _expand(expression, k + 1, prefix + r.text(i))


def iter_hosts(hosts: HostList | str, variable: str = "SLURM_JOB_NODELIST") -> Iterator[str]:
    """Every host name in order (duplicates kept, as ``scontrol show hostnames`` prints them), lazily."""
    parsed = parse_hostlist(hosts, variable) if isinstance(hosts, str) else hosts
    return itertools.chain.from_iterable(_expand(e) for e in parsed.expressions)


def first_host(hosts: HostList | str, variable: str = "SLURM_JOB_NODELIST") -> str | None:
    """The first host name (None for an empty list), without expanding any range."""
    parsed = parse_hostlist(hosts, variable) if isinstance(hosts, str) else hosts
    if not parsed.expressions:
        return None
    return "".join(p if isinstance(p, str) else p[0].text(0) for p in parsed.expressions[0])


def count_hosts(hosts: HostList | str, variable: str = "SLURM_JOB_NODELIST") -> int:
    """How many host names the list holds (duplicates counted), without expanding any range."""
    parsed = parse_hostlist(hosts, variable) if isinstance(hosts, str) else hosts
    return sum(math.prod(sum(r.size() for r in p) for p in e if not isinstance(p, str)) for e in parsed.expressions)
