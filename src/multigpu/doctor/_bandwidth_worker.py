"""The all-reduce bandwidth test's worker (inside each rank): ``-m multigpu.doctor._bandwidth_worker OUT MIB ITERS``."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import multigpu as mg
from multigpu.doctor.bandwidth import bus_bandwidth
from multigpu.monitor import write_json_atomic


def main(out: str, size_mib: int, iters: int) -> None:
    env = mg.init()
    numel = size_mib * 2**20 // 4
    buf = torch.ones(numel, dtype=torch.float32, device=env.device)

    def sync() -> None:
        if env.device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):  # warm-up: connections, buffers
        mg.all_reduce(buf, "sum", check_shapes=False)
    sync()
    mg.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    sync()
    mine = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
    seconds = mg.all_reduce(mine, "max", check_shapes=False).item()  # the slowest rank's time
    algbw, busbw = bus_bandwidth(numel * 4, seconds, env.world_size)
    if mg.is_main():
        write_json_atomic(Path(out), {"world_size": env.world_size, "backend": env.backend, "size_bytes": numel * 4,
                                "iters": iters, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": busbw})
    mg.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
