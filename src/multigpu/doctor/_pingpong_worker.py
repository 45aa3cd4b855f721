"""The ping-pong sweep's worker (inside each rank): ``-m multigpu.doctor._pingpong_worker OUT``.

Ranks 0 and 1 bounce a message of each size back and forth; the one-way time of a size is half the median
round trip (the median: this host may be busy with other work). Other ranks only join the group.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import multigpu as mg
from multigpu.monitor import write_json_atomic

SIZES = (8, 1024, 16384, 262144, 1048576, 4194304)
"""Bytes per message: latency-bound at the small end, bandwidth-bound at the large."""


def one_way_seconds(nbytes: int, rank: int, rounds: int) -> float:
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    trips = []
    for _ in range(rounds + 2):  # two warm-up round trips
        start = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        trips.append(time.perf_counter() - start)
    return statistics.median(trips[2:]) / 2


def main(out: str) -> None:
    env = mg.init()
    times = {}
    if env.rank < 2:
        for nbytes in SIZES:
            times[nbytes] = one_way_seconds(nbytes, env.rank, 40 if nbytes <= 16384 else 8)
    mg.barrier()
    if mg.is_main():
        write_json_atomic(Path(out), {"backend": env.backend, "one_way_s": {str(k): v for k, v in times.items()}})
    mg.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
