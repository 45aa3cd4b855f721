"""Latency and bandwidth of this host's gloo over loopback, from a ping-pong sweep (runs in the launcher).

    fig = measure_link()     # {"alpha_s": ..., "bandwidth": ..., "one_way_s": {bytes: seconds}}

Two CPU ranks (one thread each) bounce messages of 8 B to 4 MiB; *alpha* is the
shortest one-way time of the small messages (all but the two largest), *bandwidth*
the slope between the two largest (bytes per extra second). ``multigpu bench --predict --interconnect loopback``
uses these figures for its alpha-beta model.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["fit_alpha_beta", "measure_link"]


def fit_alpha_beta(one_way: dict[int, float]) -> tuple[float, float]:
    """``(alpha seconds, bandwidth bytes/s)`` from one-way times by message size (at least two sizes)."""
    sizes = sorted(one_way)
    # the quickest of the small messages: on a busy host one of them may have waited for a core
    alpha = min(one_way[s] for s in sizes[:max(len(sizes) - 2, 1)])
    big, bigger = sizes[-2], sizes[-1]
    extra = one_way[bigger] - one_way[big]
    bandwidth = (bigger - big) / extra if extra > 0 else (bigger / max(one_way[bigger] - alpha, 1e-9))
    return alpha, bandwidth


def measure_link(timeout_s: float = 60.0) -> dict[str, Any]:
    """Run the sweep on two CPU ranks through the real launcher; worker output goes to a log, not the terminal."""
    from multigpu.doctor.bandwidth import redirect_output
    from multigpu.launch import LaunchConfig, launch

    cfg = LaunchConfig(nproc_per_node=2, cpu=True, timeout_s=timeout_s, threads=1)
    with tempfile.TemporaryDirectory(prefix="multigpu_pingpong_") as tmp:
        out, log = Path(tmp) / "pingpong.json", Path(tmp) / "output.log"
        with open(log, "w") as fh, redirect_output(fh.fileno()):
            try:
                launch(cfg, "multigpu.doctor._pingpong_worker", [str(out)], module=True)
            except Exception:
                fh.flush()
                tail = log.read_text().strip().splitlines()[-3:]
                raise RuntimeError(" | ".join(tail) or "the ping-pong sweep failed") from None
        data = json.loads(out.read_text())
    one_way = {int(k): v for k, v in data["one_way_s"].items()}
    alpha, bandwidth = fit_alpha_beta(one_way)
    return {"alpha_s": alpha, "bandwidth": bandwidth, "one_way_s": one_way, "backend": data["backend"]}
