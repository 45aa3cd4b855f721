"""`make mutate`: would the tests notice if a rule that guards data broke? Mutation testing with mutmut.

mutmut (configured in pyproject.toml, ``[tool.mutmut]``) copies ``src/`` into ``mutants/``, makes small changes
(mutants) to the functions of the modules listed there, runs the fast tests once to learn which test calls which
function, then runs each mutant against the tests that call its function only: a mutant is *killed* when one of
them fails (or it hangs past mutmut's timeout), it *survives* when all pass. Only the functions below, the rules
of each module, are mutated; a statement that raises, says or warns is left alone (its wording is not the rule).

Prints, per module, the share of its mutants killed and every survivor with the line it changed, and exits 1 when a
module is below TARGET (docs/testing.md keeps the scores, the date, and why each survivor left is harmless).

    python tools/mutate.py              # every module (docs/testing.md: how long it took)
    python tools/mutate.py hostlist     # one module (the names below)
"""

from __future__ import annotations

import argparse
import difflib
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MUTANTS = ROOT / "mutants"
TARGET = 0.90
KILLED = {1, 3, 36, 24, -24, 152, 255}
"""mutmut's exit codes of a killed mutant: a test failed (1, 3) or the mutant hung past its timeout."""


@dataclass(frozen=True)
class Module:
    name: str
    path: str
    functions: tuple[str, ...]
    """mutmut's names of the functions mutated (globs): ``x_<function>`` or ``xǁ<Class>ǁ<method>``."""

    @property
    def dotted(self) -> str:
        return self.path.removeprefix("src/").removesuffix(".py").replace("/", ".")

    def globs(self) -> list[str]:
        return [f"{self.dotted}.{f}__mutmut_*" for f in self.functions]


MODULES = (
    Module("checkpoint store and rotation", "src/multigpu/checkpoint/store.py",
           ("xǁCheckpointStoreǁ_rotate", "xǁCheckpointStoreǁ_is_valid", "xǁCheckpointStoreǁown_problem",
            "xǁCheckpointStoreǁlatest", "xǁCheckpointStoreǁscan", "xǁCheckpointStoreǁ__init__",
            "xǁCheckpointStoreǁ_step_folders", "x_verify", "x__manifest_problem", "x_is_checkpoint")),
    Module("resume choice", "src/multigpu/checkpoint/resume.py",
           ("x_choose", "x_resolve", "x_decide", "x_planned", "x_run_of",
            "x__step_folders", "x_refuse_unusable")),
    Module("ensemble resume choice", "src/multigpu/sim/ensemble_resume.py",
           ("x_continued", "x_named", "x_own_folder", "x_is_ensemble", "x_holds_ensemble", "x_check_design")),
    Module("resize compare and fingerprint", "src/multigpu/checkpoint/resize.py",
           ("x_compare", "x_fingerprint", "x__tensors", "x_digest_check", "x_row_digest", "x_records_digest",
            "x__mix32")),
    Module("hostlist", "src/multigpu/runtime/hostlist.py", ("*",)),
    Module("run-folder agreement", "src/multigpu/launch/nodes.py",
           ("xǁNodesǁagree", "xǁNodesǁcheck_shared", "xǁNodesǁ_wait", "xǁNodesǁ_key")),
    Module("heartbeats", "src/multigpu/launch/nodes.py", ("x__beat_loop",)),
    Module("stragglers", "src/multigpu/monitor/stragglers.py",
           ("xǁStragglerWatchǁ*", "x_find", "x_describe")),
    Module("ensemble resume and seeds", "src/multigpu/sim/ensemble_store.py",
           ("xǁReplicateStoreǁ*", "x_read_replicate", "x_check_folder", "x_check_no_orphans", "x__point_dir")),
    Module("ensemble seeds and what is left", "src/multigpu/sim/ensemble.py",
           ("x__seed_of", "xǁ_Rank0ǁnext_items", "xǁ_Rank0ǁtake", "xǁ_Rank0ǁ__init__")),
    Module("infer exactly-once windows", "src/multigpu/infer/windows.py",
           ("xǁWindowPlanǁrank_bounds", "xǁWindowPlanǁowner", "xǁWindowPlanǁsegments", "xǁWindowPlanǁwindows",
            "xǁWindowPlanǁcovers", "xǁWindowPlanǁ__init__", "x_make_grid", "x__starts", "x_scan_interval")),
    Module("verify comparison", "src/multigpu/verify/compare.py",
           ("x_compare", "x__compare_leaf", "x__compare_containers", "x__compare_values", "x__round_up")),
)


def _meta() -> dict[str, int | None]:
    """Every mutant mutmut made, with its exit code (None: not run)."""
    out: dict[str, int | None] = {}
    for path in (MUTANTS / "src").rglob("*.py.meta"):
        for _ in range(20):  # mutmut rewrites a file as it goes (--report during a run)
            try:
                out.update(json.loads(path.read_text())["exit_code_by_key"])
                break
            except ValueError:
                time.sleep(0.1)
    return out


def _selected(module: Module, names) -> list[str]:
    return sorted(n for n in names if any(fnmatch.fnmatchcase(n, g) for g in module.globs()))


def _function_source(text: str, name: str) -> list[str] | None:
    """The body of mutmut's function ``name`` (``x_f__mutmut_3``, a method ``xǁCǁm__mutmut_3``) in a mutated file,
    from its ``def`` line to the next statement at its indentation or less."""
    short = name.split(".")[-1]
    lines = text.splitlines()
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith((f"def {short}(", f"async def {short}(")):
            indent = len(line) - len(stripped)
            body = [line]
            for following in lines[i + 1:]:
                if following.strip() and len(following) - len(following.lstrip()) <= indent and \
                        not following.lstrip().startswith((")", "]", "}")):
                    break
                body.append(following)
            return body
    return None


def _diff(module: Module, name: str) -> str:
    """The line(s) a mutant changed, ``- old`` / ``+ new``."""
    text = (MUTANTS / module.path).read_text()
    short = name.split(".")[-1]
    orig_name = re.sub(r"__mutmut_\d+$", "__mutmut_orig", short)
    mutant, original = _function_source(text, short), _function_source(text, orig_name)
    if mutant is None or original is None:
        return "(source not found)"
    mutant = [line.replace(short, orig_name) for line in mutant]
    changed = [line for line in difflib.unified_diff(original, mutant, lineterm="", n=0)
               if line[:1] in "+-" and line[:3] not in ("---", "+++")]
    return " | ".join(f"{line[0]} {line[1:].strip()}" for line in changed)[:400]


def report(modules: list[Module], started: float | None = None) -> int:
    meta = _meta()
    below = []
    print()
    for module in modules:
        names = _selected(module, meta)
        done = [n for n in names if meta[n] is not None]
        killed = [n for n in done if meta[n] in KILLED]
        survived = [n for n in done if meta[n] not in KILLED]
        score = len(killed) / len(done) if done else 0.0
        if score < TARGET:
            below.append(module.name)
        untested = f", {len(names) - len(done)} not run" if len(done) < len(names) else ""
        print(f"{module.name} ({module.path.removeprefix('src/')}): {score:.1%} killed ({len(killed)} of "
              f"{len(done)}{untested}){'' if score >= TARGET else f'  BELOW {TARGET:.0%}'}")
        for name in survived:
            why = {0: "survived", 5: "no test calls it", 33: "no test calls it"}.get(meta[name], f"exit {meta[name]}")
            print(f"    {why}: {name.split('.')[-1]}: {_diff(module, name)}")
    if started is not None:
        print(f"\nmake mutate: {time.monotonic() - started:.0f} s")
    if below:
        print(f"below {TARGET:.0%}: {', '.join(below)}")
    return 1 if below else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="module names (default: all): " +
                        ", ".join(m.name.split()[0] for m in MODULES))
    parser.add_argument("--report", action="store_true", help="only print the last run's scores")
    parser.add_argument("--max-children", type=int, default=3,
                        help="mutants run at once (default 3 on 2 cores: the heartbeat's tests mostly wait)")
    args = parser.parse_args(argv)
    chosen = [m for m in MODULES if not args.modules or any(m.name.startswith(w) for w in args.modules)]
    if not chosen:
        print(f"error: no module named {args.modules}; valid: {', '.join(m.name for m in MODULES)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    if not args.report:
        mutmut = Path(sys.executable).with_name("mutmut")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        cmd = [str(mutmut), "run", "--max-children", str(args.max_children),
               *[g for m in chosen for g in m.globs()]]
        MUTANTS.mkdir(exist_ok=True)
        log = MUTANTS / "mutmut.log"
        with log.open("w") as out:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        if proc.returncode not in (0, 1):
            print(f"error: mutmut ended with exit code {proc.returncode}; its output: {log}", file=sys.stderr)
            return 2
    return report(chosen, None if args.report else started)


if __name__ == "__main__":
    sys.exit(main())
