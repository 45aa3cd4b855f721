"""A rumour on a grid with two learnable parameters, calibrated by gradient descent on 2 ranks.

Agents walk at random (the built-in ``movement`` substep). An agent who has not
heard the rumour hears it with probability ``1 - (1 - p_tell)^k`` when ``k``
informed agents share its cell; an informed agent forgets it (and stays
immune) with probability ``p_forget`` per step. ``series.csv`` has the informed
and forgotten counts. Written only against the public model API: the decisions
use ``ctx.bernoulli``, which takes the straight-through gradient when the
probability is a tensor, so the same substeps run exactly (``multigpu sim``)
and differentiably (``--calibrate``), with no autograd code here.

    python examples/sim_rumour.py                  # target, then calibration from wrong starts, on 2 ranks
    multigpu sim --model examples.sim_rumour:MODEL --agents 100_000 grid=[110,110] --steps 30 --run-dir runs/t
    multigpu sim --model examples.sim_rumour:MODEL --agents 100_000 grid=[110,110] --steps 30 seed=1 \\
        params.p_tell=0.1 params.p_forget=0.05 --calibrate runs/t/series.csv --nproc-per-node 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from multigpu.sim import Model, Substep, spawn_on_grid


@dataclass(frozen=True, kw_only=True)
class RumourParams:
    p_tell: float = 0.05
    """Chance per step that one informed agent in the cell tells an uninformed one."""
    p_forget: float = 0.1
    """Chance per step that an informed agent forgets (and no longer listens)."""
    seeded: float = 0.01
    """Share informed at step 0."""
    move_prob: float = 0.5
    """Read by the built-in movement substep."""


def init(ctx, ids):
    agents = spawn_on_grid(ids, ctx.seed, ctx.grid)
    agents["informed"] = ctx.bernoulli(ids, ctx.params.seeded, "seed").to(torch.float32)
    agents["forgot"] = torch.zeros_like(agents["informed"])
    return agents


def count_informed(ctx, agents, acc):
    """acc[cell] += informed (0/1; a float with a gradient in calibration, so it is added as acc's dtype)."""
    acc.index_add_(0, ctx.cell(agents), agents["informed"].to(acc.dtype))


def hearing(ctx, counts):
    """Per cell: the chance that an uninformed agent hears the rumour this step."""
    return 1.0 - (1.0 - ctx.params.p_tell) ** counts.reshape(-1).to(torch.float64)


def spread(ctx, agents, p_hear):
    ids, informed, forgot = agents["id"], agents["informed"], agents["forgot"]
    hears = ctx.bernoulli(ids, p_hear[ctx.cell(agents)], "hear")
    forgets = ctx.bernoulli(ids, ctx.params.p_forget, "forget")
    told = (1 - informed - forgot) * hears
    lost = informed * forgets
    agents["informed"] = informed + told - lost  # assigned: the engine writes it back (exact mode)
    agents["forgot"] = forgot + lost
    return torch.stack([agents["informed"].sum(), agents["forgot"].sum()])


MODEL = Model(
    name="rumour-learnable",
    fields={"id": torch.int32, "x": torch.int16, "y": torch.int16, "informed": torch.float32, "forgot": torch.float32},
    params=RumourParams,
    init=init,
    learnable=("p_tell", "p_forget"),
    substeps=["movement",
              Substep("spread", needs=("id", "x", "y", "informed", "forgot"), apply=spread, field="cell",
                      contribute=count_informed, prepare=hearing, series=["informed", "forgot"])],
)


def _sim(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "multigpu", "sim", "--model", "examples.sim_rumour:MODEL", *args],
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=lambda s: int(s.replace("_", "")), default=100_000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=60)
    args = parser.parse_args()
    side = int((args.agents / 8) ** 0.5)  # about 8 agents per cell
    common = ["--agents", str(args.agents), "--steps", str(args.steps), "--nproc-per-node", "2", f"grid=[{side},{side}]",
              "plot=false"]
    truth = {"p_tell": 0.05, "p_forget": 0.1}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _sim(*common, "--run-dir", str(root / "target"), *(f"params.{k}={v}" for k, v in truth.items()))
        t = time.perf_counter()
        _sim(*common, "--run-dir", str(root / "fit"), "seed=1", "params.p_tell=0.1", "params.p_forget=0.05",
             "--calibrate", str(root / "target" / "series.csv"), f"calibrate.iterations={args.iterations}",
             "calibrate.tolerance=0.0005")
        wall = time.perf_counter() - t
        result = json.loads((root / "fit" / "calibration.json").read_text())
    errors = {k: abs(result["params"][k] - v) / v for k, v in truth.items()}
    print(json.dumps({"truth": truth, "learned": result["params"], "relative_error": errors,
                      "iterations": result["iterations"], "seconds_per_iteration": result["seconds_per_iteration"],
                      "wall_s": wall, "peak_rss_mb_rank0": result["peak_rss_mb_rank0"], "agents": args.agents,
                      "steps": args.steps, "world_size": result["world_size"]}, indent=1))
    if max(errors.values()) > 0.05:
        sys.exit(f"not recovered within 5%: {errors}")


if __name__ == "__main__":
    main()
