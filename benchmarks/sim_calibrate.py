"""The calibration demo at 1M agents on 2 CPU ranks: a target from the exact SIR model with beta 0.05,
then gradient descent from beta 0.02 (another seed) on the differentiable model.

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/sim_calibrate.py --agents 1_000_000 --steps 30

Prints the recovered beta, its error, iterations, seconds per iteration and rank 0's peak RSS; the memory
per agent-step of the differentiable mode comes from two runs that differ only in steps.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path


def _sim(*args: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sim", *args], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    print(proc.stdout.strip().splitlines()[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", type=lambda s: int(s.replace("_", "")), default=1_000_000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=30)
    args = parser.parse_args()
    side = int(math.sqrt(args.agents / 8))  # about 8 agents per cell
    common = ["-f", "sir", "--agents", str(args.agents), "--nproc-per-node", "2"]
    model = [f"grid=[{side},{side}]", "compile=false", "plot=false", "params.gamma=0.1",
             "params.initial_infected=0.01"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _sim(*common, "--steps", str(args.steps), "--run-dir", str(root / "target"), *model, "params.beta=0.05")
        _sim(*common, "--steps", str(args.steps), "--calibrate", str(root / "target" / "series.csv"),
             "--run-dir", str(root / "cal"), *model, "seed=1", "params.beta=0.02",
             f"calibrate.iterations={args.iterations}")
        result = json.loads((root / "cal" / "calibration.json").read_text())
        beta = result["params"]["beta"]
        print(json.dumps({**result, "beta_error": abs(beta - 0.05) / 0.05}, indent=1))
        # memory per agent-step: the same calibration for 2 iterations at steps and 2 * steps
        peaks = {}
        for steps in (args.steps, 2 * args.steps):
            _sim(*common, "--steps", str(steps), "--calibrate", str(root / "target2.csv"),
                 "--run-dir", str(root / f"mem{steps}"), *model, "params.beta=0.02", "calibrate.iterations=2") \
                if (root / "target2.csv").exists() else None
            if not (root / "target2.csv").exists():
                _sim(*common, "--steps", str(2 * args.steps), "--run-dir", str(root / "target2"), *model,
                     "params.beta=0.05")
                (root / "target2.csv").write_text((root / "target2" / "series.csv").read_text())
                _sim(*common, "--steps", str(steps), "--calibrate", str(root / "target2.csv"),
                     "--run-dir", str(root / f"mem{steps}"), *model, "params.beta=0.02", "calibrate.iterations=2")
            peaks[steps] = json.loads((root / f"mem{steps}" / "calibration.json").read_text())["peak_rss_mb_rank0"]
        per_rank = args.agents / 2
        extra = (peaks[2 * args.steps] - peaks[args.steps]) * 2**20 / (per_rank * args.steps)
        print(f"peak RSS rank 0: {peaks[args.steps]:.0f} MB at {args.steps} steps, {peaks[2 * args.steps]:.0f} MB "
              f"at {2 * args.steps} steps: {extra:.1f} bytes per agent-step")


if __name__ == "__main__":
    main()
