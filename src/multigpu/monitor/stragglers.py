"""Stragglers: a rank persistently slower than the others, named with how much and since which step (inside each
rank; the detection itself is pure).

In a data-parallel step every rank waits for the slowest in the step's collectives, so all ranks' *wall* time per
step is the same; what differs is the *busy* time (wall minus the time spent in collectives, as the step meter
measures it: :mod:`multigpu.monitor.meters`). A rank is slow in a window of steps when its busy time is at least
``ratio`` times the median of the other ranks' (and at least ``min_excess_s`` more per step, so that noise on tiny
steps is not named); it is a *straggler* once it was slow in windows in a row (two at least) covering at least
``persist`` steps. During a run the windows are the log intervals, so "since step" is the first step of the first
slow interval; at the end the run's per-step times name the step itself. It is named once, with its slowdown (its busy time / the others' median, over the streak) and
the first step of the streak; a rank that recovers keeps its entry, with the last slow step.

The step meter feeds a :class:`StragglerWatch` at every log point (one small all-reduce of each rank's busy time)
and says a newly named straggler on rank 0's output; at ``close()`` the whole run's per-step busy times are
judged again and the result goes into ``summary.json`` (``"stragglers"``), which ``multigpu report`` and
``multigpu bench`` show. Not measured (a step whose communication nobody could time): ``None``, never "none".
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["Straggler", "StragglerWatch", "describe", "find"]

RATIO = 1.5
"""Busy time / the other ranks' median at or above which a rank is slow in a window."""
MIN_EXCESS_S = 0.005
"""And at least this many seconds a step more than that median: below it, scheduling noise on a shared machine
(a rank that also runs the progress bar or the device sampler) would be named, and it costs the job little."""
PERSIST = 10
"""Steps in a row (in two windows at least) before a slow rank is named: on a shared machine a rank is often slower
for a few steps while another process holds its core (five in a row were seen often); that is not a straggler."""


@dataclasses.dataclass
class Straggler:
    rank: int
    node: int
    since_step: int
    """The first step of the slow streak (steps counted from 1, as the run counts them)."""
    last_step: int
    """The last step it was slow in so far."""
    slowdown: float
    """Its busy time / the other ranks' median busy time, over the streak."""
    busy_s: float
    """Its busy seconds per step over the streak."""
    others_busy_s: float
    """The other ranks' median busy seconds per step over the streak."""
    host: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def describe(s: Straggler | dict[str, Any]) -> str:
    """One line: ``rank 1 (node 0, host h) is 3.10x slower than the other ranks (busy 0.104 s a step vs 0.034 s)
    since step 4``."""
    d = s.as_dict() if isinstance(s, Straggler) else s
    where = f"node {d['node']}" + (f", {d['host']}" if d.get("host") else "")
    return (f"rank {d['rank']} ({where}) is {d['slowdown']:.2f}x slower than the other ranks (busy "
            f"{d['busy_s']:.3f} s a step vs {d['others_busy_s']:.3f} s) since step {d['since_step']}")


class StragglerWatch:
    """Fed one window of steps at a time (each rank's busy seconds in it); names persistent stragglers.

    ``nodes``: each rank's node (default: all on node 0); ``hosts``: each rank's host name, if known.
    """

    def __init__(self, world_size: int, *, nodes: Sequence[int] | None = None, hosts: Sequence[str] | None = None,
                 ratio: float = RATIO, min_excess_s: float = MIN_EXCESS_S, persist: int = PERSIST):
        self.world_size = world_size
        self.nodes = list(nodes) if nodes is not None else [0] * world_size
        self.hosts = list(hosts) if hosts is not None else None
        self.ratio, self.min_excess_s, self.persist = ratio, min_excess_s, persist
        self._streak: dict[int, list[tuple[int, int, float, float]]] = {}  # rank -> windows (first, last, mine, others)
        self.named: dict[int, Straggler] = {}
        """Every rank named so far (its entry updated while the streak lasts)."""

    def feed(self, first_step: int, last_step: int, busy_s: Sequence[float]) -> list[Straggler]:
        """Steps ``first_step..last_step`` (inclusive), each rank's busy seconds in them. Returns the ranks named
        for the first time by this window."""
        steps = last_step - first_step + 1
        if self.world_size < 2 or steps < 1 or len(busy_s) != self.world_size:
            return []
        new = []
        for rank, mine in enumerate(busy_s):
            others = statistics.median(b for r, b in enumerate(busy_s) if r != rank)
            slow = mine >= self.ratio * others and (mine - others) / steps >= self.min_excess_s
            if not slow:
                self._streak.pop(rank, None)
                continue
            streak = self._streak.setdefault(rank, [])
            streak.append((first_step, last_step, mine, others))
            covered = streak[-1][1] - streak[0][0] + 1
            if len(streak) < 2 or covered < self.persist:
                continue
            entry = self._entry(rank, streak)
            if rank not in self.named:
                new.append(entry)
            self.named[rank] = entry  # the streak so far (a later streak of the same rank replaces an ended one)
        return new

    def _entry(self, rank: int, streak: list[tuple[int, int, float, float]]) -> Straggler:
        n = streak[-1][1] - streak[0][0] + 1
        mine, others = sum(w[2] for w in streak), sum(w[3] for w in streak)
        return Straggler(rank=rank, node=self.nodes[rank], since_step=streak[0][0], last_step=streak[-1][1],
                         slowdown=mine / others if others > 0 else float("inf"), busy_s=mine / n,
                         others_busy_s=others / n, host=self.hosts[rank] if self.hosts else None)

    def stragglers(self) -> list[dict[str, Any]]:
        """Every rank named, as plain values (``summary.json``), slowest first."""
        return [s.as_dict() for s in sorted(self.named.values(), key=lambda s: -s.slowdown)]


def find(step_busy: Sequence[Sequence[float] | None], *, first_step: int = 1, nodes: Sequence[int] | None = None,
         hosts: Sequence[str] | None = None) -> list[dict[str, Any]] | None:
    """The stragglers of a whole run from each rank's busy seconds per step (``first_step`` is the number of the
    first); None when any rank's busy time was not measured."""
    if any(b is None for b in step_busy):
        return None
    watch = StragglerWatch(len(step_busy), nodes=nodes, hosts=hosts)
    for i, busy in enumerate(zip(*step_busy, strict=False)):
        watch.feed(first_step + i, first_step + i, busy)
    return watch.stragglers()
