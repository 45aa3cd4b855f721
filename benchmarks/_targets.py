"""The performance targets `make bench` marks met or not met, from the records' own ratios (issue #51).

Imports no torch (the runner and the renderer use it). Each :class:`Target`
names the benchmark, the ratios it reads (``fnmatch`` patterns on the ratio
names the script writes) and the bound every one of those values must meet:
a target is **met** only when it was measured and every round meets it, **not
met** when any round misses, and **not measured** when the benchmark did not
run, failed, or wrote none of the ratios (a peer not installed, say). Nothing
here is typed by hand: change a figure and the verdict follows.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

MET, NOT_MET, NOT_MEASURED = "met", "NOT met", "not measured"


@dataclass(frozen=True)
class Target:
    key: str
    """Short id, e.g. "1a" (issue #51's target 1, first half)."""
    what: str
    benchmark: str
    """The script (benchmarks/<benchmark>.py) whose record holds the ratios."""
    patterns: tuple[str, ...]
    """fnmatch patterns over the record's ratio names; every matching ratio counts."""
    at_least: float | None = None
    at_most: float | None = None
    round: int | None = None
    """Read this round only (sim_starsim's rounds are its rank counts: 1, then 2); None: every round."""
    context: tuple[str, ...] = ()
    """Patterns of the record's other ratios shown beside the verdict: what bounds it on this machine, or what a
    user gets (e.g. the model alone on 2 processes vs 1: the ceiling of any sliding window's 2-rank speed-up)."""

    def bound(self) -> str:
        return f">= {self.at_least:g}" if self.at_least is not None else f"<= {self.at_most:g}"

    def ok(self, value: float) -> bool:
        if self.at_least is not None and not value >= self.at_least:
            return False
        return not (self.at_most is not None and not value <= self.at_most)


TARGETS = (
    Target("1a", "PPO CartPole: wall to solve, 2 ranks vs 1 (same hyperparameters)", "rl_vs_cleanrl",
           ("wall to solve: ours 1 rank / ours 2 ranks",), at_least=1.6,
           context=("env-steps/s: ours 2 ranks / ours 1 rank",)),
    Target("1b", "PPO CartPole: wall to solve, CleanRL's ppo.py vs ours on 2 ranks", "rl_vs_cleanrl",
           ("wall to solve: CleanRL / ours, 2 ranks",), at_least=10.0,
           context=("env-steps/s: ours, 2 ranks / CleanRL",)),
    Target("2a", "SIR network vs Starsim, simulating, 1 process (ensemble and one large run)", "sim_starsim",
           ("starsim / ours, * simulation only",), at_least=5.0, round=1, context=("starsim / ours, * with start-up",)),
    Target("2b", "SIR network vs Starsim, simulating, 2 ranks (ensemble and one large run)", "sim_starsim",
           ("starsim / ours, * simulation only",), at_least=9.0, round=2, context=("starsim / ours, * with start-up",)),
    Target("3a", "sliding window, 1 process vs MONAI (both sizes, outputs bitwise equal)", "infer_vs_monai",
           ("ours 1 rank / MONAI windows/s*",), at_least=1.0,
           context=("ours as launched, 1 rank / MONAI windows/s*",)),
    Target("3b", "sliding window, 2 ranks vs 1 (both sizes)", "infer_vs_monai",
           ("ours 2 ranks / ours 1 rank windows/s*",), at_least=1.8,
           context=("model only: 2 processes / 1 process*",)),
    Target("4a", "training: ours (DDP) vs raw torchrun + DDP, 2 ranks", "train_peers", ("ours / raw tokens/s",),
           at_least=1.0),
    Target("4b", "training: ours (FSDP) vs raw FSDP2 (fully_shard, torch's own loop), 2 ranks", "train_peers",
           ("ours fsdp / raw fsdp2 tokens/s",), at_least=1.0),
)
TOTAL_S = 720.0
"""Target 5: the whole of `make bench` in under 12 minutes."""

def values(target: Target, record: dict, patterns: tuple[str, ...] | None = None) -> list[tuple[str, int | None, float]]:
    """(ratio name, round, value) of every ratio of ``record`` the target reads (or matching ``patterns``: its
    context), in the record's order."""
    out = []
    for r in record.get("ratios", []):
        if any(fnmatch.fnmatchcase(r["name"], p) for p in patterns or target.patterns) and r.get("value") is not None:
            if target.round is not None and r.get("round") != target.round:
                continue
            out.append((r["name"], r.get("round"), float(r["value"])))
    return out


def _record_of(target: Target, result: dict) -> dict | None:
    """The record of the target's benchmark in ``make bench``'s result; None where it did not run or failed."""
    bench = next((b for b in result.get("benchmarks", []) if b["name"] == target.benchmark), None)
    return bench.get("record", {}) if bench is not None and bench.get("status") == "ok" else None


def verdict(target: Target, result: dict) -> tuple[str, list[tuple[str, int | None, float]]]:
    """The target's status over ``make bench``'s whole result, and the values it was judged on."""
    record = _record_of(target, result)
    got = values(target, record) if record is not None else []
    if not got:
        return NOT_MEASURED, []
    return (MET if all(target.ok(v) for _, _, v in got) else NOT_MET), got


def context(target: Target, result: dict) -> list[tuple[str, int | None, float]]:
    """The figures shown beside the target's verdict (its ``context`` patterns), [] when there are none."""
    record = _record_of(target, result)
    return values(target, record, target.context) if target.context and record is not None else []


def total_verdict(result: dict) -> str:
    total = result.get("total_s")
    done = len(result.get("benchmarks", []))
    if total is None or not done:
        return NOT_MEASURED
    return MET if total < TOTAL_S else NOT_MET
