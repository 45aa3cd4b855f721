"""Agent-steps/s and bytes/agent: multigpu.sim vs the hand-written torch loop vs AgentTorch (one process).

    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/sim_throughput.py [--sizes 1e6,1e7,1e8] [--models movement,sir]
    .venv/bin/python benchmarks/sim_throughput.py --quick --json out.json     # what `make bench` runs

Each (implementation, model, size) runs in its own subprocess with one thread,
so its peak RSS is its own. The same run measures every implementation on the
same work and prints the ratios. AgentTorch is optional: skipped with a message
when it is not installed or cannot express the model.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import _record

STEPS = {1_000_000: 10, 10_000_000: 5, 100_000_000: 3}
GRID = (1000, 1000)


# ---------------------------------------------------------------------------- implementations
def _ours(model: str, n: int, steps: int, compile_: bool, native: str = "off") -> dict:
    from multigpu.sim import SimConfig, SimEngine

    cfg = SimConfig(model=model, agents=n, grid=GRID, steps=steps + 1, compile=compile_, native=native,
                    params={"beta": 0.05, "gamma": 0.05} if model == "sir" else {})
    engine = SimEngine(cfg)
    engine.step()  # warm-up (compilation)
    t = time.perf_counter()
    engine.run(steps)
    return {"seconds": time.perf_counter() - t, "bytes_per_agent": engine.state.bytes_per_agent}


def _hand(model: str, n: int, steps: int) -> dict:
    """What a user writes by hand: int64 positions from randint, a float draw per decision, no chunking."""
    import torch

    h, w = GRID
    x, y = torch.randint(0, w, (n,)), torch.randint(0, h, (n,))
    state = (torch.rand(n) < 0.001).to(torch.int8) * 2 if model == "sir" else None  # 0 S, 2 I, 3 R
    moves = torch.tensor([[0, 1], [0, -1], [1, 0], [-1, 0]])

    def step():
        nonlocal x, y, state
        move = torch.rand(n) < 0.5
        d = moves[torch.randint(0, 4, (n,))]
        x = (x + d[:, 0] * move) % w
        y = (y + d[:, 1] * move) % h
        if model == "sir":
            cell = y * w + x
            infected = torch.bincount(cell[state == 2], minlength=h * w)
            p = 1 - (1 - 0.05) ** infected[cell].float()
            u = torch.rand(n)
            new_inf = (state == 0) & (u < p)
            recover = (state == 2) & (u < 0.05)
            state = torch.where(new_inf, 2, torch.where(recover, 3, state)).to(torch.int8)

    step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    per = 16 + (1 if model == "sir" else 0)
    return {"seconds": time.perf_counter() - t, "bytes_per_agent": per}


def _agenttorch(model: str, n: int, steps: int) -> dict:
    """The same random walk written in AgentTorch's own API (config + registered substeps + Runner)."""
    try:
        import torch
        from agent_torch.core.registry import Registry
        from agent_torch.core.runner import Runner
        from agent_torch.core.substep import SubstepAction, SubstepTransition
        from omegaconf import OmegaConf
    except ImportError as exc:
        return {"skipped": f"agent-torch is not installed ({exc}); pip install -c /work/constraints.txt agent-torch"}
    if model != "movement":
        return {"skipped": "only the movement model is written in AgentTorch's API here (its covid model "
                           "needs its own population data files)"}
    h, w = GRID
    moves = torch.tensor([[0, 1], [0, -1], [1, 0], [-1, 0]])

    def random_positions(shape, params):
        return torch.stack([torch.randint(0, w, (shape[0],)), torch.randint(0, h, (shape[0],))], dim=1)

    class Decide(SubstepAction):
        def forward(self, state, observation):
            move = (torch.rand(n) < 0.5).unsqueeze(1)
            return {"direction": moves[torch.randint(0, 4, (n,))] * move}

    class Walk(SubstepTransition):
        def forward(self, state, action):
            pos = state["agents"]["walkers"]["position"]
            step = action["walkers"]["direction"]
            return {"position": (pos + step) % torch.tensor([w, h])}

    registry = Registry()
    registry.register(random_positions, "random_positions", key="initialization")
    registry.register(Decide, "decide", key="policy")
    registry.register(Walk, "walk", key="transition")
    config = OmegaConf.create({
        "simulation_metadata": {"device": "cpu", "num_episodes": 1, "num_steps_per_episode": steps + 1,
                                "num_substeps_per_step": 1, "calibration": False},
        "state": {
            "environment": None, "objects": None, "network": None,
            "agents": {"walkers": {"number": n, "properties": {"position": {
                "name": "position", "learnable": False, "shape": [n, 2], "dtype": "int",
                "initialization_function": {"generator": "random_positions", "arguments": {}}}}}},
        },
        "substeps": {"0": {
            "name": "walk", "active_agents": ["walkers"], "observation": {"walkers": None},
            "policy": {"walkers": {"decide": {"generator": "decide", "arguments": None,
                                              "input_variables": {}, "output_variables": ["direction"]}}},
            "transition": {"walk": {"generator": "walk", "arguments": None,
                                    "input_variables": {"position": "agents/walkers/position"},
                                    "output_variables": ["position"]}},
        }},
    })
    runner = Runner(config, registry)
    runner.init()
    runner.step(1)  # warm-up
    t = time.perf_counter()
    runner.step(steps)
    seconds = time.perf_counter() - t
    pos = runner.state["agents"]["walkers"]["position"]
    return {"seconds": seconds, "bytes_per_agent": pos.element_size() * pos.shape[1],
            "note": "Runner keeps a CPU copy of the state after every substep (state_trajectory)"}


def _child(impl: str, model: str, n: int, steps: int) -> None:
    import torch

    torch.set_num_threads(1)
    if impl == "ours-native":
        out = _ours(model, n, steps, compile_=False, native="on")
    elif impl == "ours":
        out = _ours(model, n, steps, compile_=False)
    elif impl == "ours-compiled":
        out = _ours(model, n, steps, compile_=True)
    elif impl == "hand":
        out = _hand(model, n, steps)
    else:
        out = _agenttorch(model, n, steps)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if "seconds" in out:
        out["agent_steps_per_s"] = n * steps / out["seconds"]
    print("RESULT " + json.dumps(out), flush=True)


def _measure(impl: str, model: str, n: int, steps: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", impl, model, str(n), str(steps)],
                          capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"skipped": f"failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:] }"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,1e8")
    parser.add_argument("--models", default="movement,sir")
    parser.add_argument("--impls", default="ours-native,ours-compiled,ours,hand,agenttorch")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=1, help="measure every implementation this many times, in turn")
    args = _record.add_flags(parser).parse_args()
    if args.child:
        impl, model, n, steps = args.child
        _child(impl, model, int(n), int(steps))
        return 0
    if args.quick:  # compiled kernels take minutes to build on CPU: the quick set leaves them out
        args.sizes, args.impls, args.rounds = "1e7", "ours-native,ours,hand,agenttorch", 1
    if args.smoke:
        args.sizes, args.models, args.impls, args.rounds = "1e4", "sir", "ours,hand", 1
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    rows = []
    print(f"{'model':<9} {'agents':>12} {'implementation':<14} {'agent-steps/s':>14} {'bytes/agent':>11} "
          f"{'peak RSS MB':>11} {'vs hand':>8}")
    ratios, notes = [], []
    for round_ in range(1, args.rounds + 1):
        for model in args.models.split(","):
            for n in sizes:
                steps = STEPS.get(n, 5)
                results = {impl: _measure(impl, model, n, steps) for impl in args.impls.split(",")}
                hand = results.get("hand", {}).get("agent_steps_per_s")
                for impl, r in results.items():
                    if "skipped" in r:
                        print(f"{model:<9} {n:>12,} {impl:<14} skipped: {r['skipped']}")
                        if round_ == 1:
                            notes.append(f"{impl} {model} {n:,}: skipped: {r['skipped']}")
                        continue
                    ratio = f"{r['agent_steps_per_s'] / hand:.2f}x" if hand else "-"
                    print(f"{model:<9} {n:>12,} {impl:<14} {r['agent_steps_per_s']:>14,.0f} {r['bytes_per_agent']:>11} "
                          f"{r['peak_rss_mb']:>11,.0f} {ratio:>8}", flush=True)
                    rows.append({"round": round_, "model": model, "agents": n, "impl": impl, "steps": steps, **r})
                    if hand and impl != "hand":
                        ratios.append(_record.ratio(f"{impl} / hand, {model} {n:,} agents",
                                                    r["agent_steps_per_s"] / hand, round_))
    print("JSON " + json.dumps(rows))
    _record.write(args, "sim_throughput", {"sizes": sizes, "models": args.models.split(","),
                                           "impls": args.impls.split(","), "rounds": args.rounds, "grid": GRID},
                  [{k: v for k, v in r.items() if k != "note"} for r in rows], ratios, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
