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


def seconds_per_all_reduce(buf: torch.Tensor, iters: int, device: torch.device) -> float:
    """Seconds of one all-reduce of ``buf``, over ``iters`` back to back.

    On CUDA, between two events on the current stream, which waits for each NCCL all-reduce there: the host
    only queues them, so its clock would time the queueing. On the CPU (gloo) the host clock is the time.
    """
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        for _ in range(iters):
            dist.all_reduce(buf)
        end.record(torch.cuda.current_stream(device))
        end.synchronize()
        return start.elapsed_time(end) / 1000.0 / iters
    start_s = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    return (time.perf_counter() - start_s) / iters


def main(out: str, size_mib: int, iters: int) -> None:
    env = mg.init()
    numel = size_mib * 2**20 // 4
    buf = torch.ones(numel, dtype=torch.float32, device=env.device)
    for _ in range(2):  # warm-up: connections, buffers
        mg.all_reduce(buf, "sum", check_shapes=False)
    if env.device.type == "cuda":
        torch.cuda.synchronize()
    mg.barrier()
    mine = torch.tensor([seconds_per_all_reduce(buf, iters, env.device)], dtype=torch.float64)
    seconds = mg.all_reduce(mine, "max", check_shapes=False).item()  # the slowest rank's time
    algbw, busbw = bus_bandwidth(numel * 4, seconds, env.world_size)
    if mg.is_main():
        write_json_atomic(Path(out), {"world_size": env.world_size, "backend": env.backend, "size_bytes": numel * 4,
                                "iters": iters, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": busbw,
                                "timing": "cuda events" if env.device.type == "cuda" else "host clock"})
    mg.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
