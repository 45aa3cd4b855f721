"""A continued ensemble (``run_ensemble(..., resume=...)``, the plain-script form of ``--resume``) ends as one
never stopped: the rounds of --until-ci are decided again from the replicates on disk as the first run decided
them, the missing ones run with their own seeds, and a grown --replicates adds the next ones."""

from __future__ import annotations

import shutil

from multigpu.sim.config import SimConfig
from multigpu.sim.ensemble import run_ensemble


def _quiet(line: str) -> None:
    pass


def _tables(run) -> dict[str, bytes]:
    return {name: (run / "ensemble" / name).read_bytes() for name in ("bands.csv", "finals.csv", "replicates.csv")}


BASE = dict(model="sir", agents=600, grid=(12, 12), steps=10, plot=False, params={"initial_infected": 0.05})


def test_an_ensemble_killed_in_its_second_round_ends_as_one_never_stopped(tmp_path):
    cfg = SimConfig(**BASE, ensemble={"replicates": 12, "min_replicates": 4, "until_ci": "95:0.2",
                                      "sweep": ["params.beta=0.1,0.3"]})
    whole = run_ensemble(cfg, run_dir=tmp_path / "whole", log=_quiet)
    rounds = [r["replicates"] for r in whole.summary["rounds"]]
    assert len(rounds) >= 2 and rounds[0] == 8, rounds
    # what a kill in the second round leaves: the first round's files and two of the second's, no tables
    part = tmp_path / "part" / "ensemble"
    def left_by_the_kill(folder: str, names: list[str]) -> list[str]:
        if folder.endswith("ensemble"):
            return [n for n in names if n not in ("manifest.json", "checksums.jsonl", "replicates")]
        return [n for n in names if int(n[1:7]) >= (6 if folder.endswith("p000000") else 4)]

    shutil.copytree(tmp_path / "whole" / "ensemble", part, ignore=left_by_the_kill)
    kept = len(list(part.glob("replicates/p*/r*.csv")))
    assert kept == 10 and sorted(p.name for p in part.iterdir()) == ["checksums.jsonl", "manifest.json", "replicates"]
    lines: list[str] = []
    done = run_ensemble(cfg, run_dir=tmp_path / "part", resume="auto", log=lines.append)
    assert _tables(tmp_path / "part") == _tables(tmp_path / "whole")
    assert [r["replicates"] for r in done.summary["rounds"]] == rounds
    assert done.summary["replicates_run"] == whole.summary["replicates"] - kept
    assert "ensemble round 1: 8 replicates (all of them kept from the run being continued)" in lines[1], lines


def test_more_replicates_continue_an_ensemble_as_if_asked_for_from_the_start(tmp_path):
    small = SimConfig(**BASE, ensemble={"replicates": 3, "sweep": ["params.beta=0.1,0.3"]})
    large = SimConfig(**BASE, ensemble={"replicates": 5, "sweep": ["params.beta=0.1,0.3"]})
    run_ensemble(small, run_dir=tmp_path / "grown", log=_quiet)
    grown = run_ensemble(large, run_dir=tmp_path / "grown", resume="auto", log=_quiet)
    run_ensemble(large, run_dir=tmp_path / "fresh", log=_quiet)
    assert grown.summary["replicates_run"] == 4 and grown.counts == [5, 5]
    assert _tables(tmp_path / "grown") == _tables(tmp_path / "fresh")


def test_the_copy_of_another_runs_replicate_is_checked_as_it_is_made(tmp_path):
    """Their file may change between the launcher's check and the copy (their owner rewrites it): the copy itself
    is checked against the checksum their run recorded, and nothing is copied from a file that does not match."""
    import json

    import pytest

    from multigpu.errors import ConfigError
    from multigpu.sim.ensemble_store import ReplicateStore

    cfg = SimConfig(**BASE, ensemble={"replicates": 3})
    run_ensemble(cfg, run_dir=tmp_path / "theirs", log=_quiet)
    theirs = tmp_path / "theirs" / "ensemble"
    victim = theirs / "replicates" / "p000000" / "r000001.csv"
    text = victim.read_text()
    victim.write_text(text.replace("1", "7", 1))
    manifest = json.loads((theirs / "manifest.json").read_text())
    manifest.pop("format")
    store = ReplicateStore(tmp_path / "mine" / "ensemble", manifest)
    with pytest.raises(ConfigError, match=rf"{victim} cannot be continued \(it does not match its checksum in "):
        store.open(theirs)  # no shapes: the folder check before the copy is left out
    assert not (tmp_path / "mine" / "ensemble" / "replicates" / "p000000" / "r000001.csv").exists()


def test_a_replicate_value_that_is_not_a_number_names_its_file_and_line(tmp_path):
    """Issue 48: an ``abc`` in a replicate file (an ensemble of format 1, which records no checksums) ended in
    ``could not convert string to float: 'abc'``, naming no file."""
    import pytest

    from multigpu.errors import ConfigError
    from multigpu.sim.ensemble_store import read_replicate

    path = tmp_path / "r000003.csv"
    path.write_text("step,S,I\n1,10,2\n2,abc,3\n")
    with pytest.raises(ConfigError, match=rf"{path} line 3 holds 'abc', not a number"):
        read_replicate(path)
