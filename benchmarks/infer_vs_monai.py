"""Sliding-window inference, measured side by side in one run (CPU ranks here; any device the ranks get).

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/infer_vs_monai.py [--size 2048] [--repeats 3]
    .venv/bin/python benchmarks/infer_vs_monai.py --quick --json out.json     # what `make bench` runs

Same model (a small conv net, 3 -> 16 -> 3 channels, fixed seed), same 1x3xSxS input,
roi 256, overlap 0.25, batch 8, Gaussian blending. Every measurement runs in its
own spawned process (one thread per rank), so its peak RSS is its own:

1. ours on 1 rank vs MONAI's ``sliding_window_inference`` (skipped without MONAI):
   windows/s and peak memory above the process's baseline;
2. ours on 2 ranks vs ours on 1 rank: speedup;
3. the stitching strategy: ours (partial canvases + owners, see runner.py) vs
   gathering every window output to rank 0 each batch and stitching there, on
   2 ranks: time, rank 0's peak memory and the bytes rank 0 receives.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import _record
import psutil
import torch

import multigpu as mg
from multigpu.infer import WindowPlan, importance_map, sliding_window
from multigpu.infer.runner import EXCHANGE_STATS
from multigpu.infer.stitch import Canvas
from multigpu.testing import run_on_ranks

ROI, OVERLAP, BATCH, BLEND = 256, 0.25, 8, "gaussian"


def _setup(size: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 3, 3, padding=1)).eval()
    x = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(1))
    return model, x


def _measure(run, size: int, repeats: int) -> dict:
    model, x = _setup(size)
    baseline = psutil.Process().memory_info().rss
    times, checksum = [], None
    run(x[:, :, :ROI, :ROI], model)  # warm-up on one window: imports, kernel selection
    for _ in range(repeats):
        mg.barrier()
        start = time.perf_counter()
        out = run(x, model)
        mg.barrier()
        times.append(time.perf_counter() - start)
        if out is not None:
            checksum = float(out.double().sum())
    return {"times": times, "baseline_mb": baseline / 2**20, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "checksum": checksum, "sent": dict(EXCHANGE_STATS), "rank": mg.rank()}


def _ours(x, model):
    return sliding_window(x, model, ROI, OVERLAP, BATCH, BLEND, progress=False)


def _monai(x, model):
    from monai.inferers import sliding_window_inference

    with torch.inference_mode():
        return sliding_window_inference(x, ROI, BATCH, model, OVERLAP, BLEND)


def _gather_windows(x, model):
    """The alternative: each batch's window outputs are gathered to rank 0, which stitches everything."""
    plan = WindowPlan([x.shape[2:]], (ROI, ROI), (OVERLAP, OVERLAP))
    bounds = plan.rank_bounds(BATCH, mg.world_size())
    start, stop = bounds[mg.rank()]
    rounds = max(-(-(b - a) // BATCH) for a, b in bounds)
    weights = importance_map((ROI, ROI), BLEND)
    canvas = Canvas(3, tuple((0, s) for s in plan.grids[0].padded_size)) if mg.rank() == 0 else None
    received = 0
    with torch.inference_mode():
        for t in range(rounds):
            lo, hi = start + t * BATCH, min(start + (t + 1) * BATCH, stop)
            if lo < hi:
                windows = list(plan.windows(lo, hi))
                batch = torch.stack([x[0][:, w.start[0]:w.start[0] + ROI, w.start[1]:w.start[1] + ROI] for w in windows])
                out, index = model(batch), torch.tensor([w.index for w in windows])
            else:
                out, index = torch.empty(0, 3, ROI, ROI), torch.empty(0, dtype=torch.int64)
            outs, indices = mg.gather(out, dst=0), mg.gather(index, dst=0)
            if canvas is not None:
                received += (outs.shape[0] - out.shape[0]) * outs[0].numel() * 4
                for i, y in zip(indices.tolist(), outs, strict=True):
                    canvas.add(y, weights, plan.window(i).start)
    EXCHANGE_STATS["received_by_rank0"] = received
    return None if canvas is None else canvas.blended(canvas.box)[None]


def _body(kind: str, size: int, repeats: int) -> dict:
    return _measure({"ours": _ours, "monai": _monai, "gather": _gather_windows}[kind], size, repeats)


def _run(kind: str, world_size: int, size: int, repeats: int) -> list[dict]:
    return run_on_ranks(_body, world_size, args=(kind, size, repeats), timeout_s=1800)


def _summary(results: list[dict], num_windows: int) -> dict:
    slowest = [max(r["times"][i] for r in results) for i in range(len(results[0]["times"]))]
    s = statistics.median(slowest)
    r0 = results[0]
    return {"s": s, "times": slowest, "wps": num_windows / s, "rank0_mb": r0["peak_mb"] - r0["baseline_mb"], "rank0_peak_mb": r0["peak_mb"],
            "checksum": r0["checksum"], "sent": [r["sent"] for r in results]}


def _line(name: str, s: dict) -> str:
    return (f"  {name:<34} {s['s']:7.2f} s  {s['wps']:7.1f} windows/s   rank 0 peak RSS {s['rank0_peak_mb']:7.0f} MiB "
            f"(+{s['rank0_mb']:.0f} MiB over its baseline)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true",
                        help="instead: one pass of ours and of MONAI in this process under cProfile (1 thread), "
                             "their top functions by own time: where each spends time outside the model")
    args = _record.add_flags(parser).parse_args()
    if args.profile:
        return _profile(args.size)
    if args.smoke:  # a few windows, one repeat: checks the script, not the speed
        args.size, args.repeats = 384, 1
    n = WindowPlan([(args.size, args.size)], (ROI, ROI), (OVERLAP, OVERLAP)).num_windows
    print(f"input 1x3x{args.size}x{args.size}, roi {ROI}, overlap {OVERLAP}, batch {BATCH}, {BLEND}: {n} windows; "
          f"median of {args.repeats} runs, 1 thread per rank, torch {torch.__version__}")
    ours1 = _summary(_run("ours", 1, args.size, args.repeats), n)
    print(_line("ours, 1 rank", ours1))
    monai1 = None
    try:
        import monai  # noqa: F401

        monai1 = _summary(_run("monai", 1, args.size, args.repeats), n)
        print(_line("MONAI sliding_window_inference", monai1))
        print(f"  ours / MONAI windows/s: {ours1['wps'] / monai1['wps']:.2f}x; extra memory ours / MONAI: "
              f"{ours1['rank0_mb'] / max(monai1['rank0_mb'], 1):.2f}x; checksums {ours1['checksum']:.6f} vs {monai1['checksum']:.6f}")
    except ImportError:
        print("  MONAI not installed: skipped (pip install monai)")
    ours2 = _summary(_run("ours", 2, args.size, args.repeats), n)
    print(_line("ours, 2 ranks", ours2))
    print(f"  speedup 2 ranks vs 1: {ours1['s'] / ours2['s']:.2f}x (checksum {ours2['checksum']:.6f}, "
          f"bitwise equal to 1 rank: {ours2['checksum'] == ours1['checksum']})")
    gather2 = None
    if not args.smoke:  # the stitching alternative: a third spawn the smoke test does without
        gather2 = _summary(_run("gather", 2, args.size, args.repeats), n)
        print(_line("gather window outputs, 2 ranks", gather2))
        ours_bytes = sum(v for s in ours2["sent"][1:] for v in s.values())
        print(f"  bytes rank 1 sent to the others: ours (canvas + owners) {ours_bytes / 2**20:.1f} MiB "
              f"{ours2['sent'][1]}, gather {gather2['sent'][0].get('received_by_rank0', 0) / 2**20:.1f} MiB; "
              f"time ours / gather {ours2['s'] / gather2['s']:.2f}x")
    _write(args, n, {"ours, 1 rank": ours1, "MONAI, 1 rank": monai1, "ours, 2 ranks": ours2,
                     "gather, 2 ranks": gather2})
    return 0


def _profile(size: int, top: int = 12) -> int:
    import cProfile
    import io
    import pstats

    torch.set_num_threads(1)
    model, x = _setup(size)
    for name, run in (("ours", _ours), ("MONAI", _monai)):
        run(x[:, :, :ROI, :ROI], model)  # warm-up, as in the timed runs
        profile = cProfile.Profile()
        profile.enable()
        run(x, model)
        profile.disable()
        text = io.StringIO()
        stats = pstats.Stats(profile, stream=text)
        stats.sort_stats("tottime").print_stats(top)
        print(f"== {name}: {stats.total_tt:.3f} s in all (profiled), top {top} by own time")
        print("\n".join(line for line in text.getvalue().splitlines()[6:] if line.strip()))
    return 0


def _write(args, num_windows: int, runs: dict) -> None:
    """The per-round figures (round i = every contender's i-th timed pass) and the ratios per round."""
    rows, ratios = [], []
    for i in range(args.repeats):
        for name, s in runs.items():
            if s is not None:
                rows.append({"round": i + 1, "contender": name, "seconds": s["times"][i],
                             "windows/s": num_windows / s["times"][i], "rank 0 peak RSS (MiB)": s["rank0_peak_mb"]})
        one, two, monai = runs["ours, 1 rank"]["times"][i], runs["ours, 2 ranks"]["times"][i], runs["MONAI, 1 rank"]
        if monai is not None:
            ratios.append(_record.ratio("ours 1 rank / MONAI windows/s", monai["times"][i] / one, i + 1))
        ratios.append(_record.ratio("ours 2 ranks / ours 1 rank windows/s", one / two, i + 1))
    ours1, monai1 = runs["ours, 1 rank"], runs["MONAI, 1 rank"]
    checks = {"2 ranks bitwise equal to 1 rank": runs["ours, 2 ranks"]["checksum"] == ours1["checksum"]}
    if monai1 is not None:
        checks["checksum ours - MONAI"] = ours1["checksum"] - monai1["checksum"]
    notes = [f"MONAI {_record.version('monai')}" if monai1 else "MONAI not installed: skipped (pip install monai)"]
    _record.write(args, "infer_vs_monai", {"size": args.size, "roi": ROI, "overlap": OVERLAP, "batch": BATCH,
                                           "blend": BLEND, "windows": num_windows, "repeats": args.repeats,
                                           **checks}, rows, ratios, notes)


if __name__ == "__main__":
    raise SystemExit(main())
