"""What a run continues from (:mod:`multigpu.checkpoint.resume`), rule by rule: the launcher's look ahead
(``planned``), its refusal of a run folder whose checkpoints are all unusable, the newest step by number, the run a
checkpoint or an ensemble folder belongs to, an ensemble's folder continued by the same rule in the sim's own code
(:mod:`multigpu.sim.ensemble_resume`: the general code knows checkpoints only), and the one choice every rank
receives, errors included. Mutation testing found these unchecked by fast tests."""

from __future__ import annotations

import json

import pytest

from multigpu.checkpoint import CheckpointStore, CorruptCheckpointError, OldLayoutError, resume
from multigpu.errors import ConfigError
from multigpu.sim import ensemble_resume
from tests.counter import Counter


def _run(tmp_path, *steps):
    run = tmp_path / "run"
    store = CheckpointStore(run / "checkpoints", keep_last=10)
    for step in steps:
        store.save(step, {"c": Counter(step)})
    return run, store


def _progress(run, name="ensemble"):
    folder = run / name
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text("{}")
    return folder


def _damage(path):
    state = path / "state.pt"
    state.write_bytes(state.read_bytes()[:-1] + bytes([state.read_bytes()[-1] ^ 1]))


def test_step_folders_are_the_newest_first_by_number_and_only_step_folders(tmp_path):
    run, store = _run(tmp_path, 9, 10, 100)
    (store.directory / "step_00000050.txt").write_text("a file")
    (store.directory / "step_x").mkdir()
    (store.directory / "other_00000200").mkdir()
    (store.directory / "step_").mkdir()
    assert [p.name for p in resume._step_folders(store.directory)] == ["step_00000100", "step_00000010",
                                                                        "step_00000009"]
    (store.directory / "step_7").mkdir()  # a number however wide
    assert [p.name for p in resume._step_folders(store.directory)][-1] == "step_7"
    assert resume._step_folders(tmp_path / "nowhere") == []


def test_the_launcher_looks_ahead_without_reading_a_checkpoints_bytes(tmp_path):
    assert resume.planned(None, str(tmp_path)) is None
    assert resume.planned("auto", None) is None
    run, store = _run(tmp_path, 2, 4)
    assert resume.planned("auto", str(run)) == store.path_for(4)
    _damage(store.path_for(4))  # a checksum the launcher does not compute: the ranks skip it
    assert resume.planned("auto", str(run)) == store.path_for(4)
    (store.path_for(4) / "state.pt").unlink()  # a file its manifest lists, missing: not complete
    assert resume.planned("auto", str(run)) == store.path_for(2)
    assert resume.planned(str(store.path_for(2)), str(run)) == store.path_for(2)
    assert resume.planned("/some/where", None) == resume.Path("/some/where")
    empty = tmp_path / "fresh"
    assert resume.planned("auto", str(empty)) is None
    folder = _progress(empty)  # an ensemble's folder: the sim's own look ahead (the general one sees no checkpoint)
    assert resume.planned("auto", str(empty)) is None
    assert ensemble_resume.own_folder(str(empty)) == folder
    assert ensemble_resume.named(str(empty)) == folder  # the run folder that holds one
    assert ensemble_resume.named(str(folder)) == folder
    assert ensemble_resume.named(str(tmp_path / "x")) is None


def test_a_run_folder_whose_checkpoints_are_all_unusable_is_refused_before_anything_starts(tmp_path):
    run, store = _run(tmp_path, 2, 4)
    resume.refuse_unusable(run)
    (store.path_for(4) / "state.pt").unlink()
    resume.refuse_unusable(run)  # step 2 is whole
    (store.path_for(2) / "manifest.json").write_text("{")
    with pytest.raises(ConfigError) as info:
        resume.refuse_unusable(run)
    message = str(info.value)
    assert message.startswith(f"--resume auto: {store.directory} holds 2 checkpoint folder(s) and none can be used "
                              "(step_00000004: ")
    assert "; step_00000002: " in message and "\n" not in message
    resume.refuse_unusable(tmp_path / "fresh")  # no checkpoints: nothing to refuse


def test_the_run_a_resume_target_belongs_to(tmp_path):
    assert resume.run_of(tmp_path / "run" / "checkpoints" / "step_00000004") == tmp_path / "run"
    assert resume.run_of(tmp_path / "run" / "ensemble") == tmp_path / "run"
    assert resume.run_of("relative/checkpoints/step_1") == (resume.Path.cwd() / "relative")


def test_an_ensemble_folder_counts_once_its_manifest_is_written(tmp_path):
    run = tmp_path / "run"
    assert ensemble_resume.own_folder(run) is None
    (run / "ensemble").mkdir(parents=True)
    assert ensemble_resume.own_folder(run) is None and not ensemble_resume.is_ensemble(run / "ensemble")
    assert not ensemble_resume.holds_ensemble(run)
    (run / "ensemble" / "manifest.json").write_text("{}")
    assert ensemble_resume.own_folder(run) == run / "ensemble" and ensemble_resume.holds_ensemble(run)
    assert ensemble_resume.own_folder(None) is None
    (run / "other").mkdir()
    (run / "other" / "manifest.json").write_text("{}")
    assert ensemble_resume.is_ensemble(run / "ensemble") and not ensemble_resume.is_ensemble(run / "other")
    assert not ensemble_resume.is_ensemble(None)


def test_an_ensemble_continues_its_folder_by_the_rule_every_run_resumes_by(tmp_path):
    said: list[str] = []
    run = tmp_path / "run"
    folder = _progress(run)
    assert ensemble_resume.continued("auto", str(run), restarts=0, say=said.append) == folder
    assert ensemble_resume.continued(None, str(run), restarts=1, say=said.append) == folder
    assert ensemble_resume.continued(None, str(run), restarts=0, say=said.append, elastic=True) == folder
    assert said == [f"continuing {folder}", f"restart 1: continuing {folder}", f"elastic start: continuing {folder}"]
    assert ensemble_resume.continued(str(run), str(tmp_path / "new"), restarts=0, say=said.append) == folder
    assert said[-1] == f"continuing {folder}"
    assert ensemble_resume.continued(str(folder), None, restarts=0, say=said.append) == folder
    assert ensemble_resume.continued("auto", str(tmp_path / "empty"), restarts=0, say=said.append) is None
    assert said[-1] == "resume=auto: no checkpoint nor ensemble/ folder yet; starting from step 0"
    _, store = _run(tmp_path, 3)  # the checkpoint rule sees the checkpoint only (a plain run of the same folder)
    assert resume.choose("auto", str(run), 0, say=said.append) == store.path_for(3)
    with pytest.raises(ConfigError, match="not a run's ensemble/ folder"):
        ensemble_resume.continued(str(tmp_path / "missing"), None, restarts=0, say=said.append)
    with pytest.raises(ConfigError, match=r"not a run's ensemble/ folder"):
        ensemble_resume.continued(str(tmp_path), None, restarts=0, say=said.append)


def test_a_restart_over_checkpoints_that_are_all_unusable_does_not_start_again_from_zero(tmp_path):
    run, store = _run(tmp_path, 2)
    _damage(store.path_for(2))
    for restarts, elastic, what in ((1, False, "restart 1"), (0, True, "elastic start")):
        with pytest.raises(ConfigError, match=rf"^{what}: .* holds 1 checkpoint folder\(s\) and none can be used"):
            resume.choose(None, str(run), restarts, say=lambda _: None, elastic=elastic)
    with pytest.raises(ConfigError, match=r"^--resume auto: "):
        resume.choose("auto", str(run), 0, say=lambda _: None)
    assert resume.choose(None, None, 1, say=lambda _: None) is None  # no run folder: nothing to continue


@pytest.mark.parametrize("kind", ["corrupt", "old", "config", "none"])
def test_resolve_gives_the_choice_or_raises_the_same_error_as_choose(tmp_path, kind):
    run, store = _run(tmp_path, 2, 4)
    if kind == "corrupt":
        _damage(store.path_for(4))
        with pytest.raises(CorruptCheckpointError, match="checksum mismatch") as info:
            resume.resolve(str(store.path_for(4)), str(run), restarts=0)
        assert str(info.value.path) == str(store.path_for(4))
    elif kind == "old":
        old = tmp_path / "old"
        (old / "checkpoints").mkdir(parents=True)
        (old / "checkpoints" / "manifest.json").write_text(json.dumps({"format": 1, "checkpoints": []}))
        (old / "checkpoints" / "ckpt_00000004.pt").write_bytes(b"x")
        with pytest.raises(OldLayoutError):
            resume.resolve("auto", str(old), restarts=0)
    elif kind == "config":
        with pytest.raises(ConfigError, match="no such file or folder"):
            resume.resolve(str(run / "nope"), str(run), restarts=0)
    else:
        assert resume.resolve("auto", str(run), restarts=0) == store.path_for(4)
        assert resume.resolve(None, str(run), restarts=2) == store.path_for(4)
        assert resume.resolve(None, str(run), restarts=0) is None


def test_the_look_ahead_reads_no_bytes_and_says_nothing(tmp_path, monkeypatch):
    """Mutation testing: the launcher leaves checksums to the ranks: a run whose only checkpoint has another
    checksum is neither refused nor warned about in the launcher (the ranks skip it, saying so)."""
    from multigpu.checkpoint import store as store_module

    said: list[str] = []
    monkeypatch.setattr(store_module, "_warn", said.append)  # the store's default warning (the rank's logger)
    run, store = _run(tmp_path, 2)
    _damage(store.path_for(2))
    (store.directory / "step_00000009").mkdir()  # no manifest: skipped, silently here
    resume.refuse_unusable(run)
    assert resume.planned("auto", str(run)) == store.path_for(2)
    assert said == []


def test_decide_once_for_the_rank_entry_point_and_a_plain_script(tmp_path):
    import dataclasses

    from multigpu.runtime.context import RunContext

    run, store = _run(tmp_path, 2, 4)
    decided = resume.decide(RunContext(run_dir=str(run), resume="auto"))
    assert decided.resume_from == str(store.path_for(4)) and decided.resume_decided is True
    assert resume.decide(decided) is decided  # decided already: nothing decided (or said) twice
    again = resume.decide(dataclasses.replace(decided, resume_from=None))
    assert again.resume_from is None  # "start fresh" stays
    fresh = resume.decide(RunContext(run_dir=str(run)))
    assert fresh.resume_from is None and fresh.resume_decided is True
    other = tmp_path / "other"
    folder = _progress(other)
    assert resume.decide(RunContext(run_dir=str(other), resume="auto")).resume_from is None  # checkpoints only
    assert ensemble_resume.continued("auto", str(other), restarts=0, say=lambda _: None) == folder  # the sim's own


def test_rank_0_chooses_and_the_others_take_its_answer_or_its_error(tmp_path, monkeypatch, capsys):
    """The one choice on every rank (a 2-rank job, its group stood in for): rank 0 chooses and says so, once; the
    others never look at the run folder and raise rank 0's error as their own; nothing to resume on a first start
    needs no collective at all (mutation testing: only one rank had ever been tested)."""
    from multigpu.errors import CorruptCheckpointError
    from multigpu.runtime import collectives, group

    run, store = _run(tmp_path, 2, 4)
    sent: list = []
    answer: dict = {}
    monkeypatch.setattr(group, "is_initialized", lambda: True)
    monkeypatch.setattr(group, "world_size", lambda: 2)
    monkeypatch.setattr(collectives, "broadcast_object", lambda obj: sent.append(obj) or answer.get("value", obj))
    monkeypatch.setattr(group, "rank", lambda: 0)
    assert resume.resolve("auto", str(run), restarts=0) == store.path_for(4)
    assert sent == [(str(store.path_for(4)), None)]
    assert capsys.readouterr().out == f"resuming from {store.path_for(4)}\n"
    assert resume.resolve(None, str(run), restarts=0) is None and len(sent) == 1  # no collective
    with pytest.raises(ConfigError, match="no such file or folder"):
        resume.resolve(str(run / "nope"), str(run), restarts=0)
    assert sent[-1][0] is None and sent[-1][1][0] == "config"
    monkeypatch.setattr(group, "rank", lambda: 1)
    elsewhere = tmp_path / "not-on-this-node"
    answer["value"] = (str(store.path_for(2)), None)
    assert resume.resolve("auto", str(elsewhere), restarts=0) == store.path_for(2)
    assert sent[-1] == (None, None) and capsys.readouterr().out == ""  # rank 1 sent nothing, said nothing
    answer["value"] = (None, ("old", "the checkpoints in x are of an earlier multigpu layout"))
    with pytest.raises(OldLayoutError, match="^the checkpoints in x are of an earlier multigpu layout$"):
        resume.resolve("auto", str(elsewhere), restarts=0)
    answer["value"] = (None, ("corrupt", (str(store.path_for(4)), "state.pt is missing")))
    with pytest.raises(CorruptCheckpointError) as info:
        resume.resolve("auto", str(elsewhere), restarts=0)
    assert (str(info.value.path), info.value.reason) == (str(store.path_for(4)), "state.pt is missing")
    answer["value"] = (None, ("config", "--resume x: no such file or folder"))
    with pytest.raises(ConfigError, match="^--resume x: no such file or folder$"):
        resume.resolve("auto", str(elsewhere), restarts=0)


def test_an_old_layout_is_refused_on_every_rank_with_its_own_message(tmp_path):
    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "checkpoints" / "manifest.json").write_text(json.dumps({"format": 1, "checkpoints": []}))
    (old / "checkpoints" / "ckpt_00000004.pt").write_bytes(b"x")
    with pytest.raises(OldLayoutError) as direct:
        resume.choose("auto", str(old), 0, say=lambda _: None)
    with pytest.raises(OldLayoutError) as resolved:
        resume.resolve("auto", str(old), restarts=0)
    assert str(resolved.value) == str(direct.value) and "earlier multigpu layout" in str(direct.value)


def test_auto_without_a_run_folder_starts_fresh():
    said: list[str] = []
    assert resume.choose("auto", None, 0, say=said.append) is None
    assert said == ["resume=auto: no checkpoint yet; starting from step 0"]
