"""Sliding-window inference, measured side by side in one run (CPU ranks here; any device the ranks get).

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/infer_vs_monai.py [--size 2048] [--rounds 3]
    .venv/bin/python benchmarks/infer_vs_monai.py --quick --json out.json     # what `make bench` runs

Same model (a small conv net, 3 -> 16 -> 3 channels, fixed seed), same 1x3xSxS input,
roi 256, overlap 0.25, batch 8, Gaussian blending. Every measurement runs in its
round spawns one process for the 1-rank contenders and one 2-rank group for the
others (one thread per rank); each runs its contenders' passes back to back
(warm-ups on one window first), the order reversed every other round, so ours
and MONAI are timed seconds apart in the same process. Each pass's peak RSS is
its own (freed heap trimmed and the peak count reset before it, Linux):

1. ours on 1 rank vs MONAI's ``sliding_window_inference`` (skipped without MONAI):
   windows/s and peak memory above the process's baseline;
2. ours on 2 ranks vs ours on 1 rank: speedup, with each rank's seconds per phase
   (``multigpu.infer.stats.PHASE_SECONDS``: cut, model, blend, idle, spill, assemble, gather,
   and the wait at the closing barrier);
3. the stitching strategy: ours (partial canvases + owners, see multigpu/infer/sliding.py) vs
   gathering every window output to rank 0 each batch and stitching there, on 2 ranks;
4. the ceiling: the model alone over each rank's share of the windows, on 1 and on
   2 processes at once, and a 64 MiB copy per process (memory bandwidth each gets
   while the other copies too): what 2 processes on this host can give at best (its
   seconds are the slowest rank's model phase; the copy, timed first, is left out);
5. ours as the launcher runs it: on 1 and 2 ranks in processes of their own with the
   heap policy ``multigpu launch``/``infer`` give CPU ranks (glibc keeps large blocks for
   reuse, multigpu/launch/heap.py), against MONAI in a plain process (1 above): what a
   user of each gets; the same-process comparison (1) is sliding_window against MONAI's
   function with the allocator equal.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import resource
import statistics
import time
from pathlib import Path

import _record
import psutil
import torch

import multigpu as mg
from multigpu.infer import WindowPlan, importance_map, sliding_window
from multigpu.infer.stats import EXCHANGE_STATS, PHASE_SECONDS
from multigpu.infer.stitch import Canvas
from multigpu.testing import run_on_ranks

ROI, OVERLAP, BATCH, BLEND = 256, 0.25, 8, "gaussian"
SIZES = ((2048, 256), (1000, 160))
"""--quick and the default: (image side, roi side) pairs, the two sizes of issue #51's target 3."""


def _setup(size: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 3, 3, padding=1)).eval()
    x = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    return model, x


def _rss_mb() -> tuple[float, float]:
    """(current RSS, peak RSS since the last reset) of this process, MiB (Linux /proc; else ru_maxrss)."""
    try:
        text = Path("/proc/self/status").read_text()
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return psutil.Process().memory_info().rss / 2**20, peak


def _reset_peak() -> None:
    """Give freed heap back to the OS and restart the peak-RSS count, so each pass's peak is its own."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _measure(run, model, x, roi: int) -> dict:
    """One timed pass of ``run`` on every rank, with this rank's phases and its own peak RSS."""
    _reset_peak()
    baseline, _ = _rss_mb()
    mg.barrier()
    start = time.perf_counter()
    out = run(x, model, roi)
    end = time.perf_counter()
    mg.barrier()
    seconds = time.perf_counter() - start
    phases = {**PHASE_SECONDS, "end barrier": time.perf_counter() - end, "total": seconds}
    checksum = float(out.double().sum()) if out is not None else None
    return {"times": [seconds], "baseline_mb": baseline, "peak_mb": _rss_mb()[1], "checksum": checksum,
            "sent": dict(EXCHANGE_STATS), "rank": mg.rank(), "phases": [phases]}


def _ceiling(x, model, roi: int = ROI):
    """What two processes on this host can give at best: each rank runs only the model over its share of the
    windows (the same batches as ``sliding_window``), nothing cut out of an image, blended or sent; and a copy
    of a 64 MiB buffer, for the memory bandwidth each rank gets while the others copy too."""
    plan = WindowPlan([x.shape[2:]], (roi, roi), (OVERLAP, OVERLAP))
    start, stop = plan.rank_bounds(BATCH, mg.world_size())[mg.rank()]
    batch = torch.rand(BATCH, 3, roi, roi)
    src, dst = torch.rand(16 << 20), torch.empty(16 << 20)  # 64 MiB each, far beyond any cache
    mg.barrier()
    begin = time.perf_counter()
    for _ in range(8):
        dst.copy_(src)
    PHASE_SECONDS["copy GB/s"] = 8 * 2 * src.numel() * 4 / (time.perf_counter() - begin) / 1e9  # read + write
    mg.barrier()
    begin = time.perf_counter()
    with torch.inference_mode():
        for lo in range(start, stop, BATCH):
            model(batch[:min(BATCH, stop - lo)])
    PHASE_SECONDS["model"] = time.perf_counter() - begin
    return None


def _ours(x, model, roi: int = ROI):
    return sliding_window(x, model, roi, OVERLAP, BATCH, BLEND, progress=False)


def _monai(x, model, roi: int = ROI):
    from monai.inferers import sliding_window_inference

    with torch.inference_mode():
        return sliding_window_inference(x, roi, BATCH, model, OVERLAP, BLEND)


def _gather_windows(x, model, roi: int = ROI):
    """The alternative: each batch's window outputs are gathered to rank 0, which stitches everything."""
    plan = WindowPlan([x.shape[2:]], (roi, roi), (OVERLAP, OVERLAP))
    bounds = plan.rank_bounds(BATCH, mg.world_size())
    start, stop = bounds[mg.rank()]
    rounds = max(-(-(b - a) // BATCH) for a, b in bounds)
    weights = importance_map((roi, roi), BLEND)
    canvas = Canvas(3, tuple((0, s) for s in plan.grids[0].padded_size)) if mg.rank() == 0 else None
    received = 0
    with torch.inference_mode():
        for t in range(rounds):
            lo, hi = start + t * BATCH, min(start + (t + 1) * BATCH, stop)
            if lo < hi:
                windows = list(plan.windows(lo, hi))
                batch = torch.stack([x[0][:, w.start[0]:w.start[0] + roi, w.start[1]:w.start[1] + roi] for w in windows])
                out, index = model(batch), torch.tensor([w.index for w in windows])
            else:
                out, index = torch.empty(0, 3, roi, roi), torch.empty(0, dtype=torch.int64)
            outs, indices = mg.gather(out, dst=0), mg.gather(index, dst=0)
            if canvas is not None:
                received += (outs.shape[0] - out.shape[0]) * outs[0].numel() * 4
                for i, y in zip(indices.tolist(), outs, strict=True):
                    canvas.add(y, weights, plan.window(i).start)
    EXCHANGE_STATS["received_by_rank0"] = received
    return None if canvas is None else canvas.blended(canvas.box)[None]


def _body(kinds: list[str], size: int, launched: bool = False, roi: int = ROI, passes: int = 1) -> dict:
    """Every kind in this one process (group), each pass right after the previous one, ``passes`` sweeps (the
    order reversed every other sweep): each kind's times are its passes' (a round's figure is their median).
    ``launched``: first the heap policy the launcher gives a CPU rank, applied as its forked workers apply it."""
    if launched:
        from multigpu.launch import heap

        assert heap.apply(heap.rank_env({})), "glibc's heap thresholds could not be set here"
    funcs = {"ours": _ours, "monai": _monai, "gather": _gather_windows, "ceiling": _ceiling}
    model, x = _setup(size)
    for kind in kinds:
        funcs[kind](x[:, :, :roi, :roi], model, roi)  # warm-up on one window: imports, kernel selection
    out = {}
    for sweep in range(passes):
        for kind in kinds if sweep % 2 == 0 else kinds[::-1]:
            PHASE_SECONDS.clear()
            m = _measure(funcs[kind], model, x, roi)
            if kind in out:  # memory and checksum: the first pass's (every pass computes the same)
                out[kind]["times"] += m["times"]
                out[kind]["phases"] += m["phases"]
                assert m["checksum"] == out[kind]["checksum"], f"{kind}: another pass gave other bits"
            else:
                out[kind] = m
    return out


def _run(kinds: list[str], world_size: int, size: int, launched: bool, roi: int = ROI,
         passes: int = 1) -> dict[str, list[dict]]:
    """Per kind, every rank's measurement."""
    results = run_on_ranks(_body, world_size, args=(kinds, size, launched, roi, passes), timeout_s=1800)
    return {kind: [r[kind] for r in results] for kind in kinds}


def _summary(results: list[dict], num_windows: int, phase: str | None = None) -> dict:
    """The slowest rank's time per pass; ``phase``: its time in that phase only (the model-only ceiling: its pass
    also measures the copy bandwidth first, which must not count)."""
    if phase is None:
        slowest = [max(r["times"][i] for r in results) for i in range(len(results[0]["times"]))]
    else:
        slowest = [max(r["phases"][i][phase] for r in results) for i in range(len(results[0]["phases"]))]
    s = statistics.median(slowest)
    r0 = results[0]
    return {"s": s, "times": slowest, "wps": num_windows / s, "rank0_mb": r0["peak_mb"] - r0["baseline_mb"], "rank0_peak_mb": r0["peak_mb"],
            "checksum": r0["checksum"], "sent": [r["sent"] for r in results],
            "phases": [r["phases"][-1] for r in results]}


def _phases(s: dict) -> str:
    """Per rank, seconds per phase of the last pass (stats.PHASE_SECONDS, plus the wait at the end barrier)."""
    order = ("cut", "model", "blend", "idle", "spill", "assemble", "gather", "end barrier", "total")
    return "; ".join(f"rank {r}: " + ", ".join(f"{k} {p[k]:.3f}" for k in order if k in p)
                     for r, p in enumerate(s["phases"]))


def _line(name: str, s: dict) -> str:
    return (f"  {name:<34} {s['s']:7.2f} s  {s['wps']:7.1f} windows/s   rank 0 peak RSS {s['rank0_peak_mb']:7.0f} MiB "
            f"(+{s['rank0_mb']:.0f} MiB over its baseline)")


CONTENDERS = {"ours, 1 rank": ("ours", 1, False), "MONAI, 1 rank": ("monai", 1, False),
              "ours, 2 ranks": ("ours", 2, False), "gather, 2 ranks": ("gather", 2, False),
              "model only, 1 rank": ("ceiling", 1, False), "model only, 2 ranks": ("ceiling", 2, False),
              "ours as launched, 1 rank": ("ours", 1, True), "ours as launched, 2 ranks": ("ours", 2, True),
              "model only as launched, 1 rank": ("ceiling", 1, True),
              "model only as launched, 2 ranks": ("ceiling", 2, True)}
"""name -> (kind, ranks, run with the launcher's heap policy: a process group of its own)"""


def _size(text: str) -> tuple[int, int]:
    size, _, roi = text.partition(":")
    return int(size), int(roi or ROI)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=_size, nargs="+", default=None, metavar="SIZE[:ROI]",
                        help=f"image side and roi side, one pass each (default and --quick: "
                             f"{' '.join(f'{a}:{b}' for a, b in SIZES)}; roi {ROI} when left out)")
    parser.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=3,
                        help="rounds; each runs every contender in a fresh process, the order reversed every "
                             "other round, so a ratio compares passes taken seconds apart")
    parser.add_argument("--passes", type=int, default=3,
                        help="passes of each contender per round, alternating within its process (the round's "
                             "figure is their median: one pass of 0.3 s varies by 30%% on a shared VM)")
    parser.add_argument("--profile", action="store_true",
                        help="instead: one pass of ours and of MONAI in this process under cProfile (1 thread), "
                             "their top functions by own time: where each spends time outside the model")
    args = _record.add_flags(parser).parse_args()
    sizes = args.size or list(SIZES)
    if args.profile:
        return _profile(*sizes[0])
    if args.smoke:  # a few windows, one round: checks the script, not the speed
        sizes, args.rounds, args.passes = [(384, ROI)], 1, 1
    try:
        import monai  # noqa: F401
    except ImportError:
        monai = None
        print("  MONAI not installed: skipped (pip install monai)")
    rows, ratios, config = [], [], {"sizes": [list(s) for s in sizes], "overlap": OVERLAP, "batch": BATCH,
                                    "blend": BLEND, "rounds": args.rounds, "passes per round": args.passes}
    for i, (size, roi) in enumerate(sizes):
        # the first size gets every contender (where the time goes); the others the pairs the targets read
        # (--quick leaves out the gather-to-rank-0 alternative: a design question settled, benchmarks/history/)
        wanted = None if i == 0 and not args.smoke else ("ours, 1 rank", "MONAI, 1 rank", "ours, 2 ranks")
        names = [k for k in CONTENDERS if (monai is not None or k != "MONAI, 1 rank") and (wanted is None or k in wanted)
                 and not (args.quick and k == "gather, 2 ranks")]
        n, runs = _one_size(size, roi, names, args.rounds, args.passes)
        size_rows, size_ratios, checks = _records(args.rounds, n, runs, f"{size} px roi {roi}")
        rows += [{"size": size, "roi": roi, **row} for row in size_rows]
        ratios += size_ratios
        config |= {f"{size} px roi {roi}: {k}": v for k, v in checks.items()} | {f"{size} px roi {roi}: windows": n}
    notes = [f"MONAI {_record.version('monai')}" if monai is not None
             else "MONAI not installed: skipped (pip install monai)"]
    _record.write(args, "infer_vs_monai", config, rows, ratios, notes)
    return 0


def _one_size(size: int, roi: int, names: list[str], rounds: int, passes: int) -> tuple[int, dict[str, list[dict]]]:
    """Every contender of ``names`` once per round at this size; per contender, its passes."""
    plan = WindowPlan([(size, size)], (roi, roi), (OVERLAP, OVERLAP))
    n, bounds = plan.num_windows, plan.rank_bounds(BATCH, 2)
    print(f"input 1x3x{size}x{size}, roi {roi}, overlap {OVERLAP}, batch {BATCH}, {BLEND}: {n} windows "
          f"(2 ranks: {[b - a for a, b in bounds]}); {rounds} rounds of {passes} passes, 1 thread per rank, "
          f"torch {torch.__version__}")
    runs: dict[str, list[dict]] = {k: [] for k in names}
    for i in range(rounds):
        print(f"round {i + 1} (load average {os.getloadavg()[0]:.2f})")
        groups = [(1, False), (2, False), (1, True), (2, True)]  # one process group each, its passes back to back
        for world_size, launched in groups if i % 2 == 0 else groups[::-1]:
            group = [k for k in names if CONTENDERS[k][1:] == (world_size, launched)]
            if not group:
                continue
            group = group if i % 2 == 0 else group[::-1]
            results = _run([CONTENDERS[k][0] for k in group], world_size, size, launched, roi, passes)
            for name in group:
                kind = CONTENDERS[name][0]
                runs[name].append(_summary(results[kind], n, "model" if kind == "ceiling" else None))
                r = runs[name][-1]
                print(_line(name, r) if kind != "ceiling" else f"  {name:<34} {r['s']:7.2f} s (the model's phase)")
                print(f"    {_phases(r)}")
        one, two = runs["ours, 1 rank"][-1]["s"], runs["ours, 2 ranks"][-1]["s"]
        line = f"  round {i + 1}: 2 ranks / 1 rank {one / two:.2f}x"
        if "MONAI, 1 rank" in runs:
            line += f"; ours / MONAI {runs['MONAI, 1 rank'][-1]['s'] / one:.2f}x"
        if "model only, 2 ranks" in runs:
            line += (f"; model only, 2 processes / 1: "
                     f"{runs['model only, 1 rank'][-1]['s'] / runs['model only, 2 ranks'][-1]['s']:.2f}x")
        if "ours as launched, 1 rank" in runs:
            launched = runs["ours as launched, 1 rank"][-1]["s"]
            two_launched = runs["ours as launched, 2 ranks"][-1]["s"]
            line += f"\n  round {i + 1}, as launched: 2 ranks / 1 rank {launched / two_launched:.2f}x"
            if "MONAI, 1 rank" in runs:
                line += f"; ours / MONAI (a plain process) {runs['MONAI, 1 rank'][-1]['s'] / launched:.2f}x"
            ceiling = (runs["model only as launched, 1 rank"][-1]["s"]
                       / runs["model only as launched, 2 ranks"][-1]["s"])
            line += f"; model only, 2 processes / 1: {ceiling:.2f}x"
        print(line)
    checksums = {name: {r["checksum"] for r in rs} for name, rs in runs.items() if CONTENDERS[name][0] != "ceiling"}
    print(f"checksums: {checksums}")
    return n, runs


def _profile(size: int, roi: int = ROI, top: int = 12) -> int:
    import cProfile
    import io
    import pstats

    torch.set_num_threads(1)
    model, x = _setup(size)
    for name, run in (("ours", _ours), ("MONAI", _monai)):
        run(x[:, :, :roi, :roi], model, roi)  # warm-up, as in the timed runs
        profile = cProfile.Profile()
        profile.enable()
        run(x, model, roi)
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(top)
        print(f"== {name}: {stats.total_tt:.3f} s in all (profiled), top {top} by own time")
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))
    return 0


def _records(rounds: int, num_windows: int, runs: dict, at: str) -> tuple[list[dict], list[dict], dict]:
    """One size's per-round figures (round i = every contender's i-th pass, taken in one sweep), its ratios per round
    (named with ``at``, the size) and its checks (bitwise equality)."""
    rows, ratios = [], []

    def ratio(name: str, value: float, round_: int) -> None:
        ratios.append(_record.ratio(f"{name}, {at}", value, round_))

    for i in range(rounds):
        for name, rs in runs.items():
            s = rs[i]
            row = {"round": i + 1, "contender": name, "seconds": s["s"], "passes (s)": s["times"]}
            if CONTENDERS[name][0] == "ceiling":
                row["copy GB/s per rank"] = [round(p["copy GB/s"], 2) for p in s["phases"]]
            else:
                row |= {"windows/s": num_windows / s["s"], "rank 0 peak RSS (MiB)": s["rank0_peak_mb"]}
            if CONTENDERS[name][0] in ("ours", "ceiling"):
                row["seconds per phase, per rank"] = _phases(s)
            rows.append(row)
        one, two = runs["ours, 1 rank"][i]["s"], runs["ours, 2 ranks"][i]["s"]
        if "MONAI, 1 rank" in runs:
            ratio("ours 1 rank / MONAI windows/s", runs["MONAI, 1 rank"][i]["s"] / one, i + 1)
        ratio("ours 2 ranks / ours 1 rank windows/s", one / two, i + 1)
        if "model only, 2 ranks" in runs:
            ratio("model only: 2 processes / 1 process",
                  runs["model only, 1 rank"][i]["s"] / runs["model only, 2 ranks"][i]["s"], i + 1)
        if "ours as launched, 1 rank" in runs:
            launched = runs["ours as launched, 1 rank"][i]["s"]
            if "MONAI, 1 rank" in runs:
                ratio("ours as launched, 1 rank / MONAI windows/s", runs["MONAI, 1 rank"][i]["s"] / launched, i + 1)
            ratio("ours as launched: 2 ranks / 1 rank windows/s",
                  launched / runs["ours as launched, 2 ranks"][i]["s"], i + 1)
            ratio("model only as launched: 2 processes / 1 process",
                  runs["model only as launched, 1 rank"][i]["s"] / runs["model only as launched, 2 ranks"][i]["s"],
                  i + 1)
    one = {r["checksum"] for r in runs["ours, 1 rank"]}
    checks = {"2 ranks bitwise equal to 1 rank": one == {r["checksum"] for r in runs["ours, 2 ranks"]}}
    if "ours as launched, 1 rank" in runs:
        checks["as launched bitwise equal"] = one == {r["checksum"] for name in ("ours as launched, 1 rank",
                                                                               "ours as launched, 2 ranks")
                                                      for r in runs[name]}
    if "MONAI, 1 rank" in runs:
        checks["checksum ours - MONAI"] = runs["ours, 1 rank"][0]["checksum"] - runs["MONAI, 1 rank"][0]["checksum"]
    return rows, ratios, checks


if __name__ == "__main__":
    raise SystemExit(main())
