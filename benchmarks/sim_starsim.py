"""SIR on a random contact network in Starsim and in multigpu: the same model, the same work, in one run.

    .venv/bin/python benchmarks/sim_starsim.py --quick --json out.json          # what `make bench` runs
    flock /tmp/multigpu-bench.lock .venv/bin/python benchmarks/sim_starsim.py   # the figures for RESULTS.md
    .venv/bin/python benchmarks/sim_starsim.py --smoke                          # the agreement check (make test)

The model, written in both (these are its only parameters): N agents; each starts CONTACTS links to
partners drawn uniformly at random, kept for the whole run (Starsim: ``RandomNet(n_contacts=2*CONTACTS,
dynamic=False, uniform_targets=True)``; multigpu: ``network.kind=random``); every day an infected agent
infects each susceptible neighbour with probability BETA (Starsim: ``ss.probperday(BETA)`` at
``dt=ss.days(1)``), then recovers with probability GAMMA (Starsim: :class:`StepSIR` below, ``ss.SIR``
with that recovery); a share INITIAL of the agents is infected on day 0. Starsim's ``results[d]`` is the
state after day d, multigpu's step d + 1.

1. Agreement: R replicates in each (Starsim ``rand_seed`` 0..R-1; multigpu ``--replicates R``); per day,
   the difference of the two means of S, I and R must lie within the 99.9% band of that difference
   (|Δ| <= 3.29 · sqrt(se₁² + se₂²)); the script exits 1 when it does not.
2. Time to the same answer, R replicates of N agents: Starsim in one process (a loop of ``Sim.run``) and
   on 2 (``MultiSim(...).run(n_cpus=2)``) against ``multigpu sim --replicates R`` on 1 and 2 ranks, each
   from its own command, one thread per process.
3. One large run (1M agents, full size): Starsim's ``Sim.run`` against ``multigpu sim`` on 1 and 2 ranks.

Each ratio starsim / ours twice: with start-up (the wall time of each side's command: imports, launcher,
processes) and the simulation alone (Starsim: ``Sim.run``/``MultiSim.run``; ours: the ensemble's own seconds, or
a run's set-up plus its steps), each against issue 51's target (>= 5x on 1 rank, >= 9x on 2), marked met / not met.

Sizes: full: 100 replicates of 100k agents for 100 days, and 1M agents; --quick: 20 of 20k for 60 days,
and 200k; --smoke: 40 of 2k for 40 days in this process, agreement only.

``--batching`` measures instead what the batch of populations gains (``ensemble.batch``, :mod:`multigpu.sim.batch`):
an ensemble in this process, one thread, batched as chosen against one engine per replicate (``batch=1``), at
several population sizes; the series are the same either way.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _record
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BETA, GAMMA, INITIAL, CONTACTS = 0.04, 0.1, 0.005, 5
SERIES = ("S", "I", "R")
Z = 3.29  # two-sided 99.9% of a normal: each difference of means, in its standard errors
SIZES = {
    "full": dict(agents=100_000, days=100, replicates=100, big=1_000_000),
    "quick": dict(agents=20_000, days=60, replicates=20, big=200_000),
    "smoke": dict(agents=2_000, days=40, replicates=40, big=0),
}
TARGETS = {1: 5.0, 2: 9.0}
"""starsim / ours that issue 51 asks for, by rank count (Starsim: the same number of processes; one run: 1)."""
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------- Starsim
def starsim_model():
    """The SIR of this benchmark in Starsim: ``ss.SIR`` whose infected recover with probability GAMMA at the end
    of each day (after that day's infections, as multigpu's ``network_sir``), never by a scheduled duration."""
    import starsim as ss

    class StepSIR(ss.SIR):
        def __init__(self, gamma=GAMMA, **kwargs):
            super().__init__(**kwargs)
            self.p_recover = ss.bernoulli(p=gamma)

        def set_progression(self, uids):
            return  # no scheduled recovery: step() draws it day by day

        def step_state(self):
            return

        def step(self):
            infectious = self.infected.uids  # those infectious when the day starts
            out = super().step()  # the day's infections, from them
            recovered = self.p_recover.filter(infectious)
            self.infected[recovered] = False
            self.recovered[recovered] = True
            return out

    return StepSIR


def starsim_sims(agents: int, days: int, replicates: int):
    import starsim as ss

    ss.options.verbose = 0
    step_sir = starsim_model()
    return [ss.Sim(n_agents=agents, start=0, stop=days - 1, dt=ss.days(1), rand_seed=r,
                   networks=ss.RandomNet(n_contacts=2 * CONTACTS, dynamic=False, uniform_targets=True),
                   diseases=step_sir(beta=ss.probperday(BETA), gamma=GAMMA, init_prev=ss.bernoulli(p=INITIAL),
                                     p_death=0))
            for r in range(replicates)]


def run_starsim(agents: int, days: int, replicates: int, procs: int) -> tuple[np.ndarray, float]:
    """[replicates, days, 3] (S, I, R after each day) and the seconds the runs took (in this process)."""
    import starsim as ss

    sims = starsim_sims(agents, days, replicates)
    t = time.perf_counter()
    if procs == 1:
        for sim in sims:
            sim.run()
    else:
        msim = ss.MultiSim(sims)
        msim.run(parallel=True, n_cpus=procs, reseed=False, shrink=True)
        sims = msim.sims
    seconds = time.perf_counter() - t
    out = []
    for sim in sims:
        res = sim.results[sim.diseases[0].name]
        out.append(np.stack([np.asarray(res[f"n_{k}"], dtype=np.float64)
                             for k in ("susceptible", "infected", "recovered")], 1))
    return np.stack(out), seconds


def _peer(args) -> int:
    """``--peer-starsim``: one Starsim contender in a process of its own (what the parent times)."""
    data, seconds = run_starsim(args.agents, args.days, args.replicates, args.procs)
    np.save(args.out, data)
    Path(args.out + ".json").write_text(json.dumps({"seconds": seconds}))
    return 0


# ----------------------------------------------------------------------------- multigpu
def _ours_args(agents: int, days: int) -> list[str]:
    return ["--model", "network_sir", "--agents", str(agents), "--steps", str(days), "network.kind=random",
            f"network.contacts={CONTACTS}", f"params.beta={BETA}", f"params.gamma={GAMMA}",
            f"params.initial_infected={INITIAL}", "plot=false"]


def run_ours(agents: int, days: int, replicates: int, ranks: int) -> tuple[dict, float, dict]:
    """``multigpu sim`` from the command line: ({series: (mean, sd, n) per day}, wall seconds, summary)."""
    with tempfile.TemporaryDirectory(prefix="sim_starsim_") as tmp:
        cmd = [sys.executable, "-m", "multigpu", "sim", *_ours_args(agents, days), "--nproc-per-node", str(ranks),
               "--run-dir", tmp] + (["--replicates", str(replicates)] if replicates > 1 else [])
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **THREADS},
                              timeout=3600)
        wall = time.perf_counter() - t
        if proc.returncode:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        if replicates > 1:
            stats = {k: ([], [], 0) for k in SERIES}
            with open(Path(tmp) / "ensemble" / "bands.csv") as fh:
                for row in csv.DictReader(fh):
                    if row["series"] in stats:
                        m, s, _ = stats[row["series"]]
                        m.append(float(row["mean"]))
                        s.append(float(row["sd"]))
                        stats[row["series"]] = (m, s, int(row["replicates"]))
            summary = json.loads((Path(tmp) / "ensemble" / "summary.json").read_text())
            return {k: (np.array(m), np.array(s), n) for k, (m, s, n) in stats.items()}, wall, summary
        with open(Path(tmp) / "series.csv") as fh:
            rows = list(csv.DictReader(fh))
        summary = json.loads((Path(tmp) / "summary.json").read_text())
        return {k: (np.array([float(r[k]) for r in rows]), np.zeros(len(rows)), 1) for k in SERIES}, wall, summary


def ours_in_process(agents: int, days: int, replicates: int) -> dict:
    """The ensemble in this process (1 rank, nothing written): {series: (mean, sd, n)}."""
    sys.path.insert(0, str(ROOT / "src"))
    from multigpu.sim.config import SimConfig
    from multigpu.sim.ensemble import run_ensemble

    cfg = SimConfig(model="network_sir", agents=agents, steps=days, plot=False,
                    network={"kind": "random", "contacts": CONTACTS},
                    params={"beta": BETA, "gamma": GAMMA, "initial_infected": INITIAL},
                    ensemble={"replicates": replicates})
    result = run_ensemble(cfg, log=lambda line: None)
    b, names = result.bands[0], result.names[0]
    return {k: (b.mean[:, names.index(k)], b.sd[:, names.index(k)], b.n) for k in SERIES}


# ----------------------------------------------------------------------------- comparing
def batching(days: int, json_args) -> int:
    """Seconds per replicate, batched (as chosen) against one engine per replicate, at several sizes."""
    sys.path.insert(0, str(ROOT / "src"))
    from multigpu.sim.batch import auto_batch
    from multigpu.sim.config import SimConfig
    from multigpu.sim.ensemble import run_ensemble

    os.environ.update(THREADS)
    import torch

    torch.set_num_threads(1)
    rows, ratios = [], []
    for agents, reps in ((1_000, 128), (4_000, 64), (20_000, 26), (100_000, 6)):
        times = {}
        for batch in (0, 1):
            cfg = SimConfig(model="network_sir", agents=agents, steps=days, plot=False,
                            network={"kind": "random", "contacts": CONTACTS},
                            params={"beta": BETA, "gamma": GAMMA, "initial_infected": INITIAL},
                            ensemble={"replicates": reps, "batch": batch})
            t = time.perf_counter()
            run_ensemble(cfg, log=lambda line: None)
            times[batch] = (time.perf_counter() - t) / reps
        size = auto_batch(SimConfig(model="network_sir", agents=agents, network={"kind": "random"}))
        print(f"{agents:>7,} agents, {days} days: batched ({size} per batch) {times[0] * 1e3:8.1f} ms per replicate, "
              f"one engine each {times[1] * 1e3:8.1f} ms: {times[1] / times[0]:.2f}x", flush=True)
        rows.append({"round": 1, "agents": agents, "replicates": reps, "per batch": size,
                     "batched (ms/replicate)": round(times[0] * 1e3, 2),
                     "one engine each (ms/replicate)": round(times[1] * 1e3, 2)})
        ratios.append(_record.ratio(f"one engine each / batched, {agents:,} agents", times[1] / times[0]))
    _record.write(json_args, "sim_starsim", {"days": days, "mode": "batching"}, rows, ratios)
    return 0


def stats_of(data: np.ndarray) -> dict:
    n = data.shape[0]
    return {k: (data[:, :, j].mean(0), data[:, :, j].std(0, ddof=1) if n > 1 else np.zeros(data.shape[1]), n)
            for j, k in enumerate(SERIES)}


def agreement(ours: dict, theirs: dict) -> dict[str, float]:
    """Per series, the largest |difference of the means| over its standard error across the days (inf where
    the means differ with no spread at all)."""
    out = {}
    for k in SERIES:
        (m1, s1, n1), (m2, s2, n2) = ours[k], theirs[k]
        diff = np.abs(m1 - m2)
        se = np.sqrt(s1**2 / n1 + s2**2 / n2)
        z = np.where(se > 0, diff / np.where(se > 0, se, 1), np.where(diff > 0, np.inf, 0.0))
        out[k] = float(z.max())
    return out


def _starsim_process(agents: int, days: int, replicates: int, procs: int) -> tuple[np.ndarray, float, float]:
    with tempfile.TemporaryDirectory(prefix="starsim_") as tmp:
        out = str(Path(tmp) / "out.npy")
        cmd = [sys.executable, __file__, "--peer-starsim", "--agents", str(agents), "--days", str(days),
               "--replicates", str(replicates), "--procs", str(procs), "--out", out]
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **THREADS}, timeout=7200)
        wall = time.perf_counter() - t
        if proc.returncode:
            raise SystemExit(f"starsim failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
        return np.load(out), wall, json.loads(Path(out + ".json").read_text())["seconds"]


def _say_agreement(z: dict[str, float], n: tuple[int, int]) -> bool:
    ok = all(v <= Z for v in z.values())
    print(f"agreement ({n[0]} vs {n[1]} replicates): largest |Δ mean| / se per series: "
          + ", ".join(f"{k} {v:.2f}" for k, v in z.items()) + f" (agree when every one <= {Z}): "
          + ("AGREE" if ok else "DISAGREE"), flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=lambda s: int(float(s.replace("_", ""))), default=None)
    parser.add_argument("--days", type=int, default=None)
    parser.add_argument("--replicates", type=int, default=None)
    parser.add_argument("--big", type=lambda s: int(float(s.replace("_", ""))), default=None,
                        help="agents of the one large run (0: none)")
    parser.add_argument("--ranks", default="1,2", help="rank counts (and Starsim processes) to time")
    parser.add_argument("--batching", action="store_true",
                        help="measure the batch of populations against one engine per replicate instead")
    parser.add_argument("--peer-starsim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--procs", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = _record.add_flags(parser).parse_args()
    if args.peer_starsim:
        return _peer(args)
    if args.batching:
        return batching(args.days or 60, args)
    mode = _record.mode(args)
    size = {**SIZES[mode], **{k: v for k, v in (("agents", args.agents), ("days", args.days),
                                                 ("replicates", args.replicates), ("big", args.big)) if v is not None}}
    config = {**size, "beta": BETA, "gamma": GAMMA, "initial_infected": INITIAL, "contacts": CONTACTS, "z": Z,
              "threads_per_process": 1}
    version = _record.version("starsim")
    if version is None:
        print("starsim is not installed: pip install 'multigpu[peers]' (or starsim==3.7.2)", flush=True)
        _record.write(args, "sim_starsim", config, [{"round": 1, "contender": "starsim", "status": "not installed"}],
                      [], ["starsim not installed"])
        return 0 if mode != "smoke" else 1
    notes = [f"starsim {version}"]
    agents, days, reps = size["agents"], size["days"], size["replicates"]
    rows, ratios = [], []
    if mode == "smoke":  # the agreement only, both in this process
        os.environ.update(THREADS)
        t = time.perf_counter()
        ours = ours_in_process(agents, days, reps)
        t_ours = time.perf_counter() - t
        data, t_theirs = run_starsim(agents, days, reps, 1)
        z = agreement(ours, stats_of(data))
        ok = _say_agreement(z, (reps, reps))
        rows.append({"round": 1, "contender": "both, in process", "replicates": reps, "agents": agents, "days": days,
                     "agree": ok, **{f"max z {k}": v for k, v in z.items()},
                     "ours (s)": round(t_ours, 2), "starsim (s)": round(t_theirs, 2)})
        ratios.append(_record.ratio("largest |Δ mean| / se (agree <= 3.29)", float(max(z.values()))))
        _record.write(args, "sim_starsim", config, rows, ratios, notes)
        return 0 if ok else 1
    ok, verdicts = True, []

    def compare(what: str, ranks: int, theirs: tuple[float, float], ours: tuple[float, float]) -> list[dict]:
        """Ratios starsim / ours, with start-up (wall of each command) and the simulation alone, against the target."""
        target = TARGETS.get(ranks)
        out = []
        for kind, t_s, t_o in (("with start-up", theirs[0], ours[0]), ("simulation only", theirs[1], ours[1])):
            value = t_s / t_o
            met = None if target is None else value >= target
            verdicts.append(f"{what}, {ranks} rank(s), {kind}: {value:.2f}x"
                            + ("" if target is None else f" (target {target:g}x: {'met' if met else 'NOT met'})"))
            out.append(_record.ratio(f"starsim / ours, {what}, {kind}", value, ranks, target=target, met=met))
        return out

    for ranks in (int(r) for r in args.ranks.split(",")):
        data, wall_s, run_s = _starsim_process(agents, days, reps, ranks)
        ours, wall_o, summary = run_ours(agents, days, reps, ranks)
        run_o = summary["seconds"]
        z = agreement(ours, stats_of(data))
        ok &= _say_agreement(z, (reps, data.shape[0]))
        print(f"{reps} replicates of {agents:,} agents, {days} days, {ranks} process(es)/rank(s): starsim "
              f"{wall_s:.1f} s wall ({run_s:.1f} s simulating, {wall_s - run_s:.1f} s start-up), multigpu "
              f"{wall_o:.1f} s wall ({run_o:.1f} s simulating, {wall_o - run_o:.1f} s start-up): starsim / multigpu "
              f"{wall_s / wall_o:.2f}x with start-up, {run_s / run_o:.2f}x simulating", flush=True)
        rows.append({"round": ranks, "contender": f"ensemble, {ranks} process(es)", "replicates": reps,
                     "agents": agents, "days": days, "starsim wall (s)": round(wall_s, 2),
                     "starsim running (s)": round(run_s, 2), "ours wall (s)": round(wall_o, 2),
                     "ours running (s)": round(run_o, 2), "agree": bool(all(v <= Z for v in z.values())),
                     **{f"max z {k}": v for k, v in z.items()}})
        ratios += compare(f"ensemble {reps} x {agents:,}", ranks, (wall_s, run_s), (wall_o, run_o))
    if size["big"]:
        data, wall_s, run_s = _starsim_process(size["big"], days, 1, 1)  # one run: Starsim has one process for it
        for ranks in (int(r) for r in args.ranks.split(",")):
            one, wall_o, summary = run_ours(size["big"], days, 1, ranks)
            run_o = summary["setup_s"] + summary["wall_s"]  # the graph and the agents, then every step
            print(f"one run of {size['big']:,} agents, {days} days: starsim (1 process) {wall_s:.1f} s wall "
                  f"({run_s:.1f} s simulating), multigpu on {ranks} rank(s) {wall_o:.1f} s wall ({run_o:.1f} s "
                  f"simulating); final R: starsim {data[0, -1, 2]:.0f}, multigpu {one['R'][0][-1]:.0f}: starsim / "
                  f"multigpu {wall_s / wall_o:.2f}x with start-up, {run_s / run_o:.2f}x simulating", flush=True)
            rows.append({"round": ranks, "contender": f"one run, {ranks} rank(s)", "agents": size["big"], "days": days,
                         "starsim wall (s)": round(wall_s, 2), "starsim running (s)": round(run_s, 2),
                         "ours wall (s)": round(wall_o, 2), "ours running (s)": round(run_o, 2),
                         "final R starsim": float(data[0, -1, 2]), "final R ours": float(one["R"][0][-1])})
            ratios += compare(f"one run of {size['big']:,} (starsim: 1 process)", ranks, (wall_s, run_s), (wall_o, run_o))
    print("targets (issue 51: starsim / ours >= 5x on 1 rank, >= 9x on 2):", *verdicts, sep="\n  ", flush=True)
    _record.write(args, "sim_starsim", config, rows, ratios, notes)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
