"""Runs CleanRL's own ``ppo.py`` (benchmarks/peers/cleanrl/, vendored unchanged) until it solves, in this process.

    python benchmarks/_cleanrl_peer.py --target 475 --window 20 -- --seed 1     # after --: ppo.py's own flags

Used by benchmarks/rl_vs_cleanrl.py (run in a temporary working directory: ppo.py writes ``runs/`` for
TensorBoard). ppo.py is run as ``__main__`` with its defaults; the only thing added is a subclass of gymnasium's
``RecordEpisodeStatistics`` (the wrapper ppo.py puts on every environment) that keeps the returns of the episodes
as they end, in step then environment order, and stops the run (an exception out of ``envs.step``) once the mean of
the last ``window`` reaches ``target``. Prints one JSON line: solved, wall (first reset to the solving step),
env-steps (every environment's steps, the reset-only steps of gymnasium 1.x's next-step autoreset included, as
ppo.py's ``global_step`` counts them), episodes, the mean at the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import runpy
import sys
import time
from pathlib import Path

import gymnasium as gym

PPO = Path(__file__).resolve().parent / "peers" / "cleanrl" / "ppo.py"


class _Solved(Exception):
    pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=float, default=475.0)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("ppo_args", nargs="*", help="ppo.py's own flags, after --")
    args = parser.parse_args()
    recent: collections.deque[float] = collections.deque(maxlen=args.window)
    state = {"start": None, "end": None, "env_steps": 0, "episodes": 0}

    class Recorded(gym.wrappers.RecordEpisodeStatistics):
        def reset(self, **kwargs):
            if state["start"] is None:
                state["start"] = time.perf_counter()
            elif getattr(self, "_stepped", False):
                state["env_steps"] += 1  # gymnasium 1.x's next-step autoreset: a step of ppo.py that only resets
            return super().reset(**kwargs)

        def step(self, action):
            self._stepped = True
            out = super().step(action)
            state["env_steps"] += 1
            if "episode" in out[4]:
                recent.append(float(out[4]["episode"]["r"]))
                state["episodes"] += 1
                if len(recent) == args.window and sum(recent) / args.window >= args.target:
                    state["end"] = time.perf_counter()
                    raise _Solved
            return out

    gym.wrappers.RecordEpisodeStatistics = Recorded
    sys.argv = [str(PPO), *args.ppo_args]
    try:
        runpy.run_path(str(PPO), run_name="__main__")
    except _Solved:
        pass
    end = state["end"] if state["end"] is not None else time.perf_counter()
    print(json.dumps({"solved": state["end"] is not None, "wall_s": end - (state["start"] or end),
                      "env_steps": state["env_steps"], "episodes": state["episodes"],
                      "mean_return": sum(recent) / len(recent) if recent else None}), flush=True)


if __name__ == "__main__":
    main()
