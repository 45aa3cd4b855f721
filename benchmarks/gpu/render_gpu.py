"""Render the GPU suite's JSON as Markdown: the GPU section of RESULTS.md and the README's GPU rows.

    python3 benchmarks/gpu/render_gpu.py OUT/gpu_results.json [--md OUT/gpu_results.md]
        [--results benchmarks/RESULTS.md] [--readme README.md]

``bash benchmarks/gpu/run_all.sh`` writes ``gpu_results.json`` (benchmarks/gpu/collect.py) and calls this at its
end on copies of RESULTS.md and README.md in its OUTDIR (a device run brings back only OUTDIR); run it here on the
JSON that came back to rewrite the real files. Like benchmarks/render.py for ``make bench``, it replaces only
what lies between its markers (``<!-- gpu:begin -->`` ... ``<!-- gpu:end -->`` in RESULTS.md,
``<!-- gpu-rows:begin -->`` ... ``<!-- gpu-rows:end -->`` in the README), so every typed line stays. No torch;
every figure comes from the JSON, nothing is typed by hand. A figure or target that was not measured is "—".
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from render import fmt, replace_block, table  # noqa: E402  (benchmarks/render.py: the CPU renderer's machinery)

RESULTS_BEGIN, RESULTS_END = "<!-- gpu:begin -->", "<!-- gpu:end -->"
README_BEGIN, README_END = "<!-- gpu-rows:begin -->", "<!-- gpu-rows:end -->"
NOT_MEASURED = "—"
WHAT = {
    "smoke": "smoke: what one GPU can run and show, check by check (each named under targets; "
             "benchmarks/gpu/README.md says what each can and cannot show)",
    "tests": "GPU tests (`pytest -m gpu tests/gpu`)",
    "tests_launch": "GPU tests: the launcher (`tests/gpu/test_launch_gpu.py`)",
    "tests_train": "GPU tests: training, timing, NCCL, devices",
    "tests_work": "GPU tests: sim, infer, envs, monitor and doctor",
    "train": "GPT-2 124M training tokens/s vs nanoGPT's bench.py loop (bf16, compile)",
    "sim": "SIR agent-steps/s on CUDA vs the same engine on the CPU",
    "infer": "sliding window vs MONAI `sliding_window_inference`",
    "envs": "CartPole env-steps/s vs gymnasium on every core",
    "doctor": "`multigpu doctor`: checks, all-reduce and host↔GPU copy bandwidth",
    "ppo": "PPO on CartPole-v1 on the GPU, the policy in the loop: training env-steps/s and time to solve",
    "checkpoint": "checkpoints from GPU ranks: the training step's stall, sync vs async, and write vs the disk "
                  "(`benchmarks/checkpoint_async.py --cuda`)",
}
"""What each step of run_all.sh measures, in the tables' words."""
RATIO = {
    "train": ("tokens/s", "ours", "nanoGPT's loop", "ours"),
    "sim": ("agent-steps/s", "CUDA", "the same engine on the CPU", "the GPU"),
    "infer": ("speed", "ours", "MONAI", "ours"),
    "envs": ("env-steps/s", "ours", "gymnasium", "ours"),
    "ppo": ("training env-steps/s", "ours", "PufferLib's published figure (one RTX 5090)", "ours"),
    "checkpoint": ("training stall per checkpoint", "async", "sync", "sync"),
}
"""Each benchmark's ratio, ours ÷ the peer's on the figure named (collect.py's ``ratio``): (figure, ours, peer, who is
faster above 1)."""


def verdict(ok: bool | None) -> str:
    return NOT_MEASURED if ok is None else "met" if ok else "not met"


def _tests_text(step: dict[str, Any]) -> str:
    t = step.get("tests")
    if not t:
        return NOT_MEASURED
    return f"{t['passed']} passed, {t['failures'] + t['errors']} failed, {t['skipped']} skipped"


def _result_text(name: str, step: dict[str, Any]) -> str:
    if name == "tests" or name.startswith("tests_"):
        return _tests_text(step)
    record = step.get("record") or {}
    if step.get("peer_missing"):  # loud: the comparison this row is for did not run
        ours = f"ours only ({fmt(record['summary'])}); " if record.get("summary") else ""
        return f"{ours}**PEER MISSING**: {fmt(step['peer_missing'])}"
    if "checks" in record:  # the smoke step
        ok = sum(bool(c.get("ok")) for c in record["checks"])
        return f"{ok} of {len(record['checks'])} checks ran"
    ratio = record.get("ratio")
    parts = []
    if ratio is not None:
        figure, ours, peer, faster = RATIO.get(name, ("figure", "ours", "the peer", "ours"))
        parts.append(f"{figure}: {ours} {ratio:#.3g}x {peer} (above 1: {faster} faster)")
    if record.get("summary"):
        parts.append(fmt(record["summary"]))
    return "; ".join(parts) or NOT_MEASURED


def _status_text(name: str, step: dict[str, Any]) -> str:
    """A step's status; a tests step that failed with no test failed says so (its process's exit code failed it,
    after every test passed: a check of the session, a worker left behind), so the row reads as its counts do."""
    status = step["status"]
    t = step.get("tests")
    if (name == "tests" or name.startswith("tests_")) and status == "failed" and t and t["passed"] \
            and not t["failures"] + t["errors"]:
        return f"failed: exit code {step.get('rc', '?')} after every test passed"
    return status


def _targets_of(data: dict[str, Any], step: str) -> list[tuple[str, bool | None]]:
    return [(name.split(": ", 1)[1], ok) for name, ok in data.get("targets", {}).items()
            if name.split(": ", 1)[0] == step]


def _side(label: str, side: Any) -> list[str]:
    """One side's figures: a dict's scalars as a table, a list of dicts as rows."""
    if isinstance(side, dict):
        scalars = {k: v for k, v in side.items() if not isinstance(v, (dict, list))}
        return ["", f"{label}: " + ", ".join(f"{k}={fmt(v)}" for k, v in scalars.items())] if scalars else []
    if isinstance(side, list) and side and all(isinstance(r, dict) for r in side):
        rows = [{k: v for k, v in r.items() if not isinstance(v, (dict, list))} for r in side]
        return ["", f"{label}:", "", *table(rows)]
    return []


def _calls(data: dict[str, Any]) -> list[str]:
    """The start of every call the steps came from, in order (one, unless several calls were merged)."""
    seen = [s.get("call") or data.get("started") for s in data.get("steps", {}).values()]
    return list(dict.fromkeys(c for c in seen if c)) or [data.get("started", "?")]


def _provenance(data: dict[str, Any]) -> str:
    """Which call(s) and which source the rows come from."""
    text = (data.get("source") or {}).get("text")
    calls = _calls(data)
    if len(calls) == 1:
        return f"one device call, started {calls[0]}, " + (f"source {text}" if text else "source not recorded")
    return (f"{len(calls)} device calls (started {', '.join(calls)}; each row names its call in the call column), "
            + (f"the last one's source {text}" if text else "source not recorded"))


def markdown(data: dict[str, Any]) -> str:
    """The whole GPU run: machine, every step's outcome, every target, then each benchmark's figures."""
    m = data.get("machine") or {}
    several = len(_calls(data)) > 1
    lines = [f"Generated by `benchmarks/gpu/render_gpu.py` from `gpu_results.json` "
             f"(`bash benchmarks/gpu/run_all.sh`, {_provenance(data)}).",
             f"Machine: {m.get('gpu') or 'no GPU'} × {m.get('gpu_count', 0)}, driver {m.get('driver', '?')}, "
             f"torch {m.get('torch', '?')}, CUDA {m.get('cuda', '?')}, {m.get('cpu_cores', '?')} CPU cores.", "",
             "| step | what | status | s | result |" + (" call |" if several else ""),
             "|---|---|---|---|---|" + ("---|" if several else "")]
    for name, step in data.get("steps", {}).items():
        status = _status_text(name, step) + (f" ({fmt(step['note'])})" if step.get("note") else "")
        seconds = step.get("seconds")
        lines.append(f"| {name} | {WHAT.get(name, name)} | {status} | {fmt(None if seconds is None else round(seconds))} | "
                     f"{_result_text(name, step)} |" + (f" {step.get('call') or data.get('started')} |" if several else ""))
    if data.get("targets"):
        lines += ["", "| target | result |", "|---|---|"]
        lines += [f"| {fmt(name)} | {verdict(ok)} |" for name, ok in data["targets"].items()]
    for name, step in data.get("steps", {}).items():
        failing = (step.get("tests") or {}).get("failing") or []
        record = step.get("record")
        if not failing and not record:
            continue
        lines += ["", f"#### {name}", ""]
        lines += [f"- failed: `{f['test']}`: {fmt(f['message'])}" for f in failing]
        if record:
            if record.get("config"):
                lines.append("config: " + ", ".join(f"{k}={fmt(v)}" for k, v in record["config"].items()))
            lines += _side("ours", record.get("ours"))
            peer = record.get("peer")
            lines += _side("peer", peer) if peer is not None else ["", "peer: none"]
    return "\n".join(lines) + "\n"


def readme_rows(data: dict[str, Any]) -> str:
    """The README's GPU rows: one per step that ran, its ratio to its peer (named, with which way is faster) and
    its targets."""
    steps = {n: s for n, s in data.get("steps", {}).items() if s.get("status") != "skipped"}
    gpu = (data.get("machine") or {}).get("gpu")
    if not steps or not gpu:
        return "GPU rows: none yet (see \"GPU status\" under \"CPU and GPU\").\n"
    several = len(_calls(data)) > 1
    lines = [f"GPU rows, from `bash benchmarks/gpu/run_all.sh` on one {gpu} ({_provenance(data)}; "
             "details in benchmarks/RESULTS.md, \"GPU suite\"):", "",
             "| GPU workload | status | result | targets |" + (" call |" if several else ""),
             "|---|---|---|---|" + ("---|" if several else "")]
    for name, step in steps.items():
        targets = "; ".join(f"{fmt(t)}: {verdict(ok)}" for t, ok in _targets_of(data, name)) or NOT_MEASURED
        lines.append(f"| {WHAT.get(name, name)} | {_status_text(name, step)} | {_result_text(name, step)} | {targets} |"
                     + (f" {step.get('call') or data.get('started')} |" if several else ""))
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json", type=Path)
    p.add_argument("--md", type=Path, default=None, help="default: gpu_results.md beside the JSON")
    p.add_argument("--results", type=Path, default=None, help="rewrite the GPU block of this RESULTS.md")
    p.add_argument("--readme", type=Path, default=None, help="rewrite the GPU rows block of this README.md")
    args = p.parse_args()
    try:
        data = json.loads(args.json.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"error: cannot read {args.json}: {exc}; run `bash benchmarks/gpu/run_all.sh` first", file=sys.stderr)
        return 2
    block = markdown(data)
    md = args.md or args.json.with_suffix(".md")
    md.write_text(block)
    print(f"wrote {md}")
    for path, text, begin, end, heading in (
        (args.results, block, RESULTS_BEGIN, RESULTS_END, "## GPU suite (generated)"),
        (args.readme, readme_rows(data), README_BEGIN, README_END, "### GPU rows (generated)"),
    ):
        if path is not None:
            old = path.read_text() if path.exists() else ""
            path.write_text(replace_block(old, text, heading, begin=begin, end=end))
            print(f"updated the {begin} block in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
