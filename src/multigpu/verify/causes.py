"""Why a result may differ between world sizes: what ``multigpu verify`` says after a FAIL (pure; in the launcher).

:func:`likely_causes` reads the script's source for the lines that make a result depend on the world size by
construction, each named with its line: a seed that depends on the rank (nanoGPT's ``seed_offset = ddp_rank``),
a loss or an accumulation count divided by the world size, a mean of per-rank means, a DataLoader with no
sampler that splits the data.
:data:`CHECKS` is what to check when none is seen (or for a workload, whose code is ours).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["CHECKS", "Cause", "likely_causes"]

_RANK = r"(?:\b(?:ddp_)?(?:local_)?rank\b|RANK|process_index|global_rank|seed_offset|get_rank\(\)|mg\.rank\(\))"
_SEED = re.compile(r"(?:manual_seed|\.seed\(|seed_everything|set_seed|\bseed\s*=)")
_SEED_PER_RANK = re.compile(r"seed_per_rank\s*=\s*True")
_RANK_OFFSET = re.compile(rf"\bseed_offset\s*=\s*.*{_RANK}")
_WORLD = r"(?:\b(?:ddp_)?world_size\b|WORLD_SIZE|num_processes|get_world_size\(\)|mg\.world_size\(\))"
_DIVIDED = re.compile(rf"(?:/=|//=|/|//)\s*(?:int\()?\s*(?:[\w.]+\.)?{_WORLD}")
_LOSS = re.compile(r"\bloss", re.IGNORECASE)
_ACCUMULATION = re.compile(r"accum", re.IGNORECASE)
_MEAN_OF_MEANS = re.compile(r"all_reduce\(.*\.mean\(\).*(?:[\"']mean[\"']|AVG)")
_LOADER = re.compile(r"\bDataLoader\(")
_SPLIT = re.compile(r"Sampler|sampler\s*=|mg\.shard|\bshard\(|setup_dataloaders|accelerator\.prepare|\.prepare\(")


@dataclass(frozen=True)
class Cause:
    line: int
    """1-based line of the script."""
    code: str
    """The line as written (stripped)."""
    why: str

    def describe(self, script: str) -> str:
        return f"{script}:{self.line}: `{self.code}`: {self.why}"


CHECKS = (
    "every rank seeds alike (a seed plus the rank gives each rank other random numbers than the 1-rank run)",
    "the data is split over the ranks, not repeated (DistributedSampler, mg.shard), and the global batch (per-rank "
    "batch x ranks x accumulation) is the same at every world size",
    "nothing is divided by the world size by hand (DDP averages the gradients already)",
    "a result made of every rank's part is gathered before it is recorded (mg.verify.record(name, value, "
    "gather=True)), not taken from rank 0 alone",
    "a difference near 1e-6 relative is float summation order: compare with --rtol",
)
"""What to check when no line of the script shows a cause."""


def _prose_lines(source: str) -> set[int]:
    """Lines inside a string of several lines (a docstring): prose, not code."""
    import io
    import tokenize

    prose: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.STRING and tok.end[0] > tok.start[0]:
                prose.update(range(tok.start[0], tok.end[0] + 1))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass  # a script that does not parse: every line is read
    return prose


def likely_causes(source: str) -> list[Cause]:
    """The lines of ``source`` (a script) that make a result depend on the world size, in line order."""
    causes = []
    prose = _prose_lines(source)
    lines = [("" if n in prose else line) for n, line in enumerate(source.splitlines(), 1)]
    for number, raw in enumerate(lines, 1):
        code = raw.split("#", 1)[0].strip()
        if not code:
            continue
        if _SEED_PER_RANK.search(code) or (_SEED.search(code) and re.search(_RANK, code)) or _RANK_OFFSET.search(code):
            causes.append(Cause(number, code, "a seed that depends on the rank: each rank draws other random "
                                              "numbers (batches, dropout, initial weights) than the 1-rank run; seed "
                                              "every rank alike (mg.init(seed=S)) and let a sampler split the data"))
        elif _MEAN_OF_MEANS.search(code):
            causes.append(Cause(number, code, "a mean of the ranks' means: the global mean only when every rank holds "
                                              "as many items; reduce the sums and the counts, then divide"))
        elif _DIVIDED.search(code) and _LOSS.search(code):
            causes.append(Cause(number, code, "the loss divided by the world size: DDP averages the gradients over "
                                              "the ranks already, so at N ranks they are N times smaller"))
        elif _DIVIDED.search(code) and _ACCUMULATION.search(code):
            causes.append(Cause(number, code, "the accumulation steps divided by the world size: the samples per "
                                              "optimizer step stay the same only where it divides evenly, and each "
                                              "rank's micro-steps see other samples than the 1-rank run's (equal "
                                              "within a tolerance at best)"))
    if any(_LOADER.search(line) for line in lines) and not any(_SPLIT.search(line) for line in lines):
        number = next(n for n, line in enumerate(lines, 1) if _LOADER.search(line))
        causes.append(Cause(number, lines[number - 1].strip(), "a DataLoader with no sampler that splits the data: "
                                                               "every rank reads all of it, so N ranks train on N "
                                                               "times the samples (add a DistributedSampler)"))
    return sorted(causes, key=lambda c: c.line)
