"""`multigpu doctor` on this machine as one JSON record: its checks, its all-reduce bandwidth, and host<->GPU copies.

    python benchmarks/gpu/doctor_gpu.py [--json OUT.json]
    python benchmarks/gpu/doctor_gpu.py --quick       # without the bandwidth test (seconds)

The doctor's bandwidth test runs one NCCL rank per GPU where there are two or
more, else two CPU ranks on gloo (a figure for the gloo and ``cpu`` sync
paths). Beside it, the host<->GPU copy bandwidth from pinned memory (what the
``cpu`` sync backend and sliding_window's batch copies move through),
the median of 5 copies of ``--copy-mib`` MiB each way. The NVML sampler runs
during benchmarks/gpu/train_mfu.py (its record's ``sampler``).
"""

from __future__ import annotations

import dataclasses
import statistics

import _common
import torch


def copy_bandwidth(device: torch.device, mib: int, repeats: int = 5) -> dict:
    host = torch.empty(mib * 2**20, dtype=torch.uint8).pin_memory()
    dev = torch.empty_like(host, device=device)
    out = {}
    for name, fn in (("host_to_device_gbps", lambda: dev.copy_(host, non_blocking=True)),
                     ("device_to_host_gbps", lambda: host.copy_(dev, non_blocking=True))):
        fn()
        times = [_common.timed(fn, device)[1] for _ in range(repeats)]
        out[name] = host.numel() / statistics.median(times) / 1e9
    return out


def main() -> int:
    p = _common.parser(__doc__)
    p.add_argument("--skip-bandwidth", action="store_true", help="skip the doctor's all-reduce test")
    p.add_argument("--copy-mib", type=int, default=512)
    _common.add_estimate_flag(p)
    args = p.parse_args()
    if args.estimate:  # the bandwidth test starts ranks of its own; copies of --copy-mib at ~20 GB/s, a few times
        return _common.print_estimate({"start": _common.STARTUP_S, "checks": 3.0,
                                       "all-reduce bandwidth": 0.0 if args.skip_bandwidth else 8.0,
                                       "host<->GPU copies": 1.0 + 10 * args.copy_mib / 20_000})
    from multigpu.doctor import gather_facts, run_checks

    facts = gather_facts(bandwidth=not (args.quick or args.skip_bandwidth))
    checks = run_checks(facts)
    for c in checks:
        print(f"  {c.name:<26} {c.status:<5} {c.detail}", flush=True)
    device = _common.pick_device("cpu" if args.quick and args.device == "auto" else args.device)
    copies = copy_bandwidth(device, args.copy_mib) if device.type == "cuda" else {"skipped": "no GPU"}
    print(f"  host<->GPU copies: {copies}", flush=True)
    failed = [c.name for c in checks if c.status == "fail"]
    _common.write_record(args.json, {
        "benchmark": "doctor_gpu", "machine": _common.machine(),
        "ours": {"checks": [dataclasses.asdict(c) for c in checks], "bandwidth": facts.bandwidth,
                 "bandwidth_error": facts.bandwidth_error, "copies": copies},
        "peer": None, "ratio": None, "targets": {"no failed check": not failed},
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
