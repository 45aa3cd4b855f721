"""``multigpu sim --replicates/--sweep/--until-ci``: bad input in one line, and a killed ensemble continued.

The kill test pins the on-disk contract that a resume builds on: a replicate's file is there whole or not
at all, so the replicates of a killed ensemble are the files present; ``--resume auto`` (here on another
number of ranks) runs only the others, rewrites none of them, and each file holds exactly the series of a
single run with that replicate's seed.
"""

from __future__ import annotations

import csv
import json

import pytest

from multigpu.config import from_dict
from multigpu.sim.config import SimConfig
from multigpu.sim.design import replicate_seed
from multigpu.sim.engine import SimEngine
from tests.conftest import ROOT, assert_bad_input, fault_callback, run_cli


@pytest.mark.parametrize("args, message", [
    (["--replicates", "3", "--until-ci", "95"], "sim.ensemble.until_ci '95' is invalid; valid: LEVEL:WIDTH"),
    (["--until-ci", "95:0.01"], "--until-ci 95:0.01 needs --replicates N"),
    (["--replicates", "3", "--sweep", "beta"], "--sweep 'beta' is invalid; valid: NAME=v1,v2,..."),
    (["--replicates", "3", "--sweep", "seed=1,2"], "--sweep seed: seed cannot be swept"),
    (["--sweep", "bta=1,2"], "--sweep bta: not a parameter of the model nor a simulation key; valid: move_prob"),
    (["--sweep", "params.beta=0.1,2"], "--sweep point 1 (params.beta=2): sim.params.beta=2.0 is invalid"),
    (["--sweep", "agents=10,0"], "--sweep point 1 (agents=0): sim.agents=0 is invalid"),
    (["--replicates", "3", "--save-agents", "x.npz"], "--save-agents does not combine with an ensemble"),
    (["--replicates", "3", "--checkpoint-every", "2"], "--checkpoint-every does not combine with an ensemble"),
    (["--sweep-file", "/no/such.csv"], "sim.ensemble.sweep_file '/no/such.csv' cannot be read"),
    (["--replicates", "2", "--agents", "2000000000", "ensemble.split=replicates"],
     "does not fit"),
])
def test_bad_ensembles_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, monkeypatch, args, message):
    monkeypatch.chdir(ROOT)
    assert_bad_input(["sim", "-f", "sir", *args, "--run-dir", str(tmp_path / "run")], message, capsys, tmp_path / "run")


def _replicate_files(folder):
    return {p: (p.read_text(), p.stat().st_ino, p.stat().st_mtime_ns)
            for p in sorted(folder.glob("ensemble/replicates/p*/r*.csv"))}


def _series(path) -> dict[str, list]:
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    return {k: [int(r[k]) for r in rows] for k in rows[0]}


@pytest.mark.e2e
@pytest.mark.fault
def test_a_killed_ensemble_continues_with_the_replicates_it_has(tmp_path):
    """Rank 0 is SIGKILLed after the third wave (one replicate per rank and wave: six written), as a crashed
    machine ends it: the launcher stops the other rank; the run goes on from the files on disk."""
    run = tmp_path / "run"
    kill, env = fault_callback(tmp_path, rank=0, step=3)
    args = ["-f", "sir", "--agents", "5000", "--steps", "20", "grid=[25,25]", "plot=false", "compile=false",
            "--replicates", "30", "--sweep", "params.beta=0.05,0.1", "--run-dir", str(run), "ensemble.wave=1", kill]
    killed = run_cli("sim", *args, "--nproc-per-node", "2", env=env, timeout=240)
    assert killed.returncode != 0 and "rank 0 of 2" in killed.stderr, killed.stderr[-3000:]
    before = _replicate_files(run)
    assert len(before) == 6, f"{len(before)} replicates before the kill; 3 waves of 2 ranks x 1 were written"
    assert not (run / "ensemble" / "bands.csv").exists()
    half = run / "ensemble" / "replicates" / "p000001" / ".r000029.csv.tmp99999"  # as if killed mid-write
    half.parent.mkdir(parents=True, exist_ok=True)
    half.write_text("step,moved,S,I,R\n1,2,")

    done = run_cli("sim", "--resume", "auto", "--run-dir", str(run), "--nproc-per-node", "1", "callbacks=[]",
                   timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    after = _replicate_files(run)
    assert len(after) == 60
    assert all(after[p] == before[p] for p in before), "a replicate written before the kill was written again"
    assert not half.exists() and not list(run.glob("ensemble/replicates/p*/.r*"))
    summary = json.loads((run / "ensemble" / "summary.json").read_text())
    assert summary["replicates_run"] == 60 - len(before) and summary["world_size"] == 1
    assert [p["replicates"] for p in summary["points"]] == [30, 30]
    with open(run / "ensemble" / "finals.csv") as fh:
        assert {r["replicates"] for r in csv.DictReader(fh)} == {"30"}
    # a replicate from before the kill and one from after: the series of a single run with its seed
    resolved = json.loads((run / "run.json").read_text())["config"]
    resolved.pop("ensemble")
    for path in (min(before), max(set(after) - set(before)), half.with_name("r000029.csv")):
        p, r = int(path.parent.name[1:]), int(path.stem[1:])
        cfg = from_dict(SimConfig, {**resolved, "params": {**resolved["params"], "beta": (0.05, 0.1)[p]},
                                    "seed": replicate_seed(resolved["seed"], p, r)})
        assert _series(path) == SimEngine(cfg).run(), path


def _tables(folder) -> dict[str, bytes]:
    return {name: (folder / "ensemble" / name).read_bytes() for name in ("bands.csv", "finals.csv")}


@pytest.mark.e2e
@pytest.mark.fault
def test_a_restarted_ensemble_ends_as_an_uninterrupted_one_and_resumes_like_any_run(tmp_path, capsys, monkeypatch):
    """Rank 1 is SIGKILLed in the second round of --until-ci (6 waves in); --max-restarts 1 restarts the group,
    which continues the ensemble from its folder: the bands are those of a run never killed. The finished run
    (in runs/sim/<time>, no --run-dir) is then what `--resume auto` finds and `--resume PATH` continues, and a
    change of its design, a count below what it holds, or a damaged replicate file is one line before anything
    starts."""
    from multigpu.sim.ensemble import run_ensemble

    kill, env = fault_callback(tmp_path, rank=1, step=6)
    design = ["-f", "sir", "--agents", "1500", "--steps", "12", "grid=[15,15]",
              "params.initial_infected=0.05", "plot=false", "compile=false", "--replicates", "12",
              "ensemble.min_replicates=4", "--until-ci", "95:0.2", "--sweep", "params.beta=0.1,0.3", "ensemble.wave=1"]
    restarted = run_cli("sim", *design, kill, "--nproc-per-node", "2", "--max-restarts", "1", env=env,
                        cwd=tmp_path, timeout=240)
    assert restarted.returncode == 0, (restarted.stdout + restarted.stderr)[-3000:]
    [run] = (tmp_path / "runs" / "sim").iterdir()
    assert f"restart 1: continuing {run / 'ensemble'}" in restarted.stdout, restarted.stdout[-3000:]
    summary = json.loads((run / "ensemble" / "summary.json").read_text())
    assert [r["replicates"] for r in summary["rounds"]] == [8, 11] and summary["replicates"] == 19
    assert 0 < summary["replicates_run"] < 19  # the second attempt kept what the first one wrote
    resolved = json.loads((run / "run.json").read_text())["config"]
    resolved["callbacks"] = []
    reference = run_ensemble(from_dict(SimConfig, resolved), run_dir=tmp_path / "ref", log=lambda line: None)
    assert [r["replicates"] for r in reference.summary["rounds"]] == [8, 11]
    assert _tables(run) == _tables(tmp_path / "ref"), "the restarted ensemble's bands differ from an uninterrupted run's"

    # refused before anything starts, one line each: its design changed, fewer replicates than it holds, a damaged file
    monkeypatch.chdir(tmp_path)
    assert_bad_input(["sim", "--resume", "auto", "--sweep", "params.beta=0.1,0.2"], "sim.ensemble.sweep", capsys)
    assert_bad_input(["sim", "--resume", "auto", "--replicates", "5"], "sim.ensemble.replicates is 5 here", capsys)
    victim = min(run.glob("ensemble/replicates/p000001/r*.csv"))
    whole = victim.read_bytes()
    for damaged, why in ((whole[: len(whole) // 2], "cut short"), (whole.replace(b"step,moved", b"step,other"),
                                                                    "its columns are")):
        victim.write_bytes(damaged)
        line = assert_bad_input(["sim", "--resume", "auto"], why, capsys)
        assert str(victim) in line and "not a whole replicate" in line, line
    victim.write_bytes(whole)
    stray = run / "ensemble" / "replicates" / "p000002"  # a point this design does not have
    stray.mkdir()
    assert_bad_input(["sim", "--resume", "auto"], f"{stray} is not a point of this ensemble", capsys)
    stray.rmdir()
    manifest = run / "ensemble" / "manifest.json"  # lost: its replicates are neither continued nor run over
    manifest.rename(tmp_path / "manifest.json")
    assert_bad_input(["sim", "--resume", "auto", "--run-dir", str(run)], "no readable manifest.json", capsys)
    (tmp_path / "manifest.json").rename(manifest)
    assert _tables(run) == _tables(tmp_path / "ref")

    # --resume auto without --run-dir: the newest ensemble run, continued (nothing left to run)
    again = run_cli("sim", "--resume", "auto", "--nproc-per-node", "1", cwd=tmp_path, env=env, timeout=240)
    assert again.returncode == 0 and f"--resume auto continues runs/sim/{run.name}" in again.stdout, (again.stdout + again.stderr)[-3000:]
    assert json.loads((run / "ensemble" / "summary.json").read_text())["replicates_run"] == 0
    # --resume PATH: that ensemble folder, continued into another run folder (it is left as it was)
    other = tmp_path / "other"
    copied = run_cli("sim", "--resume", str(run / "ensemble"), "--run-dir", str(other), "--nproc-per-node", "1",
                     cwd=tmp_path, env=env, timeout=240)
    assert copied.returncode == 0, (copied.stdout + copied.stderr)[-3000:]
    assert json.loads((other / "ensemble" / "summary.json").read_text())["replicates_run"] == 0
    assert _tables(other) == _tables(tmp_path / "ref") == _tables(run)


@pytest.mark.e2e
def test_continuing_another_users_ensemble_copies_its_files_checked_and_made_this_runs_own(tmp_path):
    """Issue 48: `--resume THEIRS/ensemble --run-dir mine` hard-linked their replicate files into this run: `mine`
    then held files of their owner and mode (0666 here), sharing inodes with their folder, and when they rewrote one
    in place the next resume used it (an R band of 495.7 [-642, 1634] instead of ~2.4). Copies now: this run's
    files, checked against the checksums their run recorded; what they do to theirs later changes nothing here."""
    import os

    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    design = ["-f", "sir", "--agents", "2000", "--steps", "10", "grid=[20,20]", "plot=false", "compile=false"]
    first = run_cli("sim", *design, "--replicates", "4", "--run-dir", str(theirs), "--nproc-per-node", "1",
                    env={"OMP_NUM_THREADS": "1"})
    assert first.returncode == 0, first.stderr[-3000:]
    files = sorted(theirs.glob("ensemble/replicates/p000000/r*.csv"))
    assert len(files) == 4
    for f in files:
        f.chmod(0o666)  # as their owner left them: anyone may write
    cont = run_cli("sim", "--resume", str(theirs / "ensemble"), "--replicates", "6", "--run-dir", str(mine),
                   "--nproc-per-node", "1", env={"OMP_NUM_THREADS": "1"})
    assert cont.returncode == 0, cont.stderr[-3000:]
    ours = mine / "ensemble" / "replicates" / "p000000"
    new_one = (ours / "r000005.csv").stat()  # one this run wrote itself: the mode and owner copies must have
    for f in files:
        copy = ours / f.name
        assert copy.read_bytes() == f.read_bytes()
        st = copy.stat()
        assert st.st_ino != f.stat().st_ino and st.st_nlink == 1, f"{copy} is a link to {f}"
        assert (st.st_uid, st.st_mode & 0o777) == (new_one.st_uid, new_one.st_mode & 0o777) == (os.geteuid(), 0o600)
    bands = (mine / "ensemble" / "bands.csv").read_bytes()
    # their owner rewrites one of their files in place (same inode): nothing of it reaches this run
    kept = (ours / files[0].name).read_bytes()
    with open(files[0], "r+b") as fh:
        fh.seek(len(kept) - 3)
        fh.write(b"99")
    assert (ours / files[0].name).read_bytes() == kept
    again = run_cli("sim", "--resume", "auto", "--run-dir", str(mine), "--nproc-per-node", "1",
                    env={"OMP_NUM_THREADS": "1"})
    assert again.returncode == 0, again.stderr[-3000:]
    assert (mine / "ensemble" / "bands.csv").read_bytes() == bands
