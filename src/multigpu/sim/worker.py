"""The rank entry point of ``multigpu sim`` (inside each rank).

    python -m multigpu.sim.worker RUN_DIR/resolved_config.json     # normally via `multigpu sim`
    multigpu bench --nproc 1,2 sim agents=2000000                   # configs/sir.yaml + overrides

The launcher wrote the resolved config (``{"sim": ..., "run": {...}}``); every
rank reads it, joins the job, runs :func:`multigpu.sim.run`, and rank 0 prints
the figures and output paths.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import multigpu as mg
from multigpu.config import from_dict, load_config
from multigpu.monitor import run_dir_from_env
from multigpu.sim.config import SimConfig
from multigpu.sim.runner import run


def _load(argv: list[str]) -> tuple[SimConfig, dict]:
    """A resolved JSON config (from `multigpu sim`), or a YAML file plus key=value overrides
    (from `multigpu bench sim`, whose run directory is ``$MULTIGPU_RUN_DIR``)."""
    path = Path(argv[0])
    if path.suffix == ".json":
        resolved = json.loads(path.read_text())
        return from_dict(SimConfig, resolved["sim"], prefix="sim"), resolved.get("run", {})
    return load_config(SimConfig, path, argv[1:], prefix="sim"), {"run_dir": run_dir_from_env()}


def main(argv: list[str]) -> int:
    cfg, opts = _load(argv)
    mg.init(backend=cfg.backend)
    try:
        result = run(cfg, run_dir=opts.get("run_dir"), resume=opts.get("resume"), profile=opts.get("profile", False))
        if result is not None:
            _report(result)
    finally:
        mg.shutdown()
    return 0


def _report(result) -> None:
    s = result.summary
    last = {k: v[-1] for k, v in result.series.items() if v and k != "step"}
    print(f"sim {s['model']} ({s['strategy']}, {s['world_size']} ranks): {s['num_agents']:,} agents, "
          f"{s['final_step']} steps, {s['throughput']:,.0f} agent-steps/s "
          f"(comm {s['comm_share']:.0%}, imbalance {s['imbalance']:.2f}, "
          f"{s['bytes_per_agent']} bytes/agent, peak RSS {max(s['peak_rss_mb']):,.0f} MB per rank)")
    if last:
        print("final: " + ", ".join(f"{k} {v:,.4g}" if isinstance(v, float) else f"{k} {v:,}" for k, v in last.items()))
    for r in s["rebalances"][-1:]:
        print(f"rebalance at step {r['step']}: imbalance {r['imbalance_before']:.3f} -> {r['imbalance_after']:.3f}")
    if result.csv_path:
        print(f"series: {result.csv_path}")
    if result.plot_path:
        print(f"plot: {result.plot_path}")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
