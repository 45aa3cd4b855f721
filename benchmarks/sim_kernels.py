"""Per-kernel profile of one rank's SIR step, torch.compile'd vs the C kernels, against this machine's copy bandwidth.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/sim_kernels.py [--agents 5e6] [--rounds 3]

One process, one thread, one rank's share of agents (5M = 10M on 2 ranks), sorted by row as the
engine keeps them. The same run measures the memory bandwidth (``dst.copy_(src)`` of 256 MiB, read
+ write bytes per second), then each kernel over 2^18-agent chunks, in rounds that alternate the
implementations ("sort order" is the stable order by row, once per sort_every steps;
the reorder of the fields after it is not included; "move_count" is move + infected + strays in one pass,
what the engine runs for the built-in sir model). Bytes/agent is the least traffic a kernel needs (agent fields read + written; the
per-cell tables stay in cache); "of bw" = (agents/s x bytes/agent) / copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

CHUNK = 1 << 18
GRID = (1000, 1000)
BYTES = {"move": 12, "infected": 5, "transition": 10, "strays": 2, "move_count": 13, "sort order": 2 + 8}


def _best(fn, reps: int = 3) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=lambda s: int(float(s)), default=5_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from types import SimpleNamespace

    from multigpu.sim import native, rng
    from multigpu.sim.models import FUSED_KERNELS, KERNELS, SIRParams, _sir_prepare

    if not native.available():
        raise SystemExit("no C compiler here: only the torch kernels can run")
    n, (h, w) = args.agents, GRID
    g = torch.Generator().manual_seed(0)
    ids = torch.arange(n, dtype=torch.int32)
    x = torch.randint(0, w, (n,), generator=g).to(torch.int16)
    y = torch.sort(torch.randint(0, h, (n,), generator=g)).values.to(torch.int16)
    state = torch.where(torch.rand(n, generator=g) < 0.3, 2, 0).to(torch.uint8)
    acc = torch.zeros(h * w + 1, dtype=torch.int32)
    impls = {"compiled": {k: torch.compile(f, dynamic=True) for k, f in {**KERNELS, **FUSED_KERNELS}.items()},
             "native": native.kernels()}
    prep = _sir_prepare(SimpleNamespace(params=SIRParams(), env={}, kernels={}), acc[:-1].view(h, w))
    move_thr = rng.threshold(0.5, 16)

    def chunked(body):
        def run():
            for a in range(0, n, CHUNK):
                body(a, min(a + CHUNK, n))
        return run

    def jobs(k, impl):
        return {
            "move": chunked(lambda a, b: k["move"](ids[a:b], x[a:b], y[a:b], 5, move_thr, h, w)),
            "infected": chunked(lambda a, b: k["infected"](acc, x[a:b], y[a:b], state[a:b], 0, w)),
            "transition": chunked(lambda a, b: k["transition"](ids[a:b], x[a:b], y[a:b], state[a:b], 7, prep[0], 0,
                                                                w, prep[1], prep[2])),
            "move_count": chunked(lambda a, b: k["move_count"](ids[a:b], x[a:b], y[a:b], state[a:b], 5, move_thr, h,
                                                                w, acc, 0)),
            "strays": chunked((lambda a, b: native.outside(y[a:b], 400, 600)) if impl == "native" else
                              (lambda a, b: torch.nonzero((y[a:b] < 400) | (y[a:b] >= 600)).reshape(-1))),
            "sort order": (lambda: native.row_order(y, h)) if impl == "native" else
                               (lambda: torch.argsort(y, stable=True)),
        }

    src = torch.ones(1 << 28, dtype=torch.uint8)
    dst = torch.empty_like(src)
    for impl, k in impls.items():  # warm-up: compilation
        for fn in jobs(k, impl).values():
            fn()
    rows = []
    for r in range(1, args.rounds + 1):
        bw = 2 * src.numel() / _best(lambda: dst.copy_(src)) / 1e9
        print(f"round {r}: copy bandwidth {bw:.1f} GB/s (read + write)")
        times = {}
        for impl in impls:
            for name, fn in jobs(impls[impl], impl).items():
                times[(impl, name)] = _best(fn)
        for name in BYTES:
            tc, tn = times[("compiled", name)], times[("native", name)]
            for impl, t in (("compiled", tc), ("native", tn)):
                rate = n / t
                share = rate * BYTES[name] / (bw * 1e9)
                print(f"  {name:<16} {impl:<9} {t * 1e3:8.1f} ms {rate / 1e6:8.1f} M agents/s "
                      f"{BYTES[name]:>3} B/agent {share:6.1%} of bw")
                rows.append({"round": r, "kernel": name, "impl": impl, "ms": t * 1e3, "agents_per_s": rate,
                             "bytes_per_agent": BYTES[name], "bandwidth_gbs": bw, "share_of_bw": share})
            print(f"  {name:<16} native / compiled: {tc / tn:.2f}x")
    print("JSON " + json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
