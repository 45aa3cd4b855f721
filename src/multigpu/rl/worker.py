"""The ``multigpu rl`` worker: runs inside each rank, started by the launcher.

    python -m multigpu.rl.worker RUN_DIR/resolved_config.json

Reads the resolved config the launcher wrote, joins the job, trains, and
has rank 0 write ``summary.json`` (through the step meter) into the run directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import multigpu as mg
from multigpu.config import from_dict
from multigpu.rl.config import RLConfig
from multigpu.rl.ppo import train


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    cfg = from_dict(RLConfig, json.loads(path.read_text())["rl"])
    mg.init(backend="auto", seed=cfg.seed, threads=cfg.threads)
    train(cfg, run_dir=path.parent, log=lambda line: print(line, flush=True))
    mg.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
