"""The one checkpoint store: step_*/ folders with a checksummed manifest, rotation, atomic saves,
damage named, old layouts refused in one line, plain / per-rank / sharded (DCP) parts, on 1 and 2 ranks."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from multigpu.checkpoint import (
    CheckpointStore,
    CheckpointWriteError,
    CorruptCheckpointError,
    OldLayoutError,
    PerRank,
    Sharded,
    check_resume_path,
    choose,
)
from multigpu.checkpoint import store as store_module
from multigpu.errors import ConfigError
from multigpu.testing import run_on_ranks
from tests.counter import Counter


def _store(tmp_path, keep_last=3, warnings=None):
    return CheckpointStore(tmp_path / "checkpoints", keep_last, warn=(warnings if warnings is not None else []).append)


def test_save_writes_step_folders_with_a_manifest_and_keeps_the_last_k(tmp_path):
    store = _store(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        store.save(step, {"counter": Counter(step), "extra": {"lr": 0.1 * step}}, meta={"shapes": [step]})
    names = sorted(p.name for p in store.directory.iterdir())
    assert names == ["step_00000002", "step_00000003"]  # rotated; no temporary left
    manifest = json.loads((store.directory / "step_00000003" / "manifest.json").read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and manifest["meta"] == {"shapes": [3]}
    assert sorted(manifest["files"]) == ["state.pt"]
    assert store.latest() == store.path_for(3)
    counter = Counter()
    loaded = store.load(store.latest(), {"counter": counter, "extra": None})
    assert counter.value == 3 and loaded["extra"] == {"lr": pytest.approx(0.3)}


@pytest.mark.parametrize("damage, reason", [
    ("truncate", "state.pt is truncated"),
    ("flip", "state.pt: checksum mismatch"),
    ("plant", "evil.pt is not listed in its manifest.json"),
    ("remove", "state.pt is missing"),
])
def test_a_damaged_checkpoint_is_skipped_by_name_and_the_previous_one_used(tmp_path, damage, reason):
    warnings: list[str] = []
    store = _store(tmp_path, warnings=warnings)
    store.save(1, {"counter": Counter(1)})
    store.save(2, {"counter": Counter(2)})
    state = store.path_for(2) / "state.pt"
    data = state.read_bytes()
    if damage == "truncate":
        state.write_bytes(data[:100])
    elif damage == "flip":
        state.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "plant":
        (store.path_for(2) / "evil.pt").write_bytes(b"x")
    else:
        state.unlink()
    assert store.latest() == store.path_for(1)
    assert len(warnings) == 1 and reason in warnings[0] and "step_00000002" in warnings[0], warnings
    with pytest.raises(CorruptCheckpointError, match=reason):
        check_resume_path(str(store.path_for(2)))
    with pytest.raises(CorruptCheckpointError, match=reason):
        store.load(store.path_for(2), {"counter": Counter()})


def test_a_full_disk_leaves_no_temporary_and_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    store = _store(tmp_path)
    store.save(1, {"counter": Counter(1)})
    before = {p.name: p.read_bytes() for p in store.path_for(1).iterdir()}

    def no_room(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module, "atomic_write", no_room)
    with pytest.raises(CheckpointWriteError) as info:
        store.save(2, {"counter": Counter(2)})
    assert str(info.value) == (f"could not write checkpoint {store.path_for(2)}: No space left on device (ENOSPC); "
                               "the previous checkpoint step_00000001 is intact")
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000001"]  # no .tmp left behind
    assert {p.name: p.read_bytes() for p in store.path_for(1).iterdir()} == before


def test_a_save_killed_midway_leaves_a_hidden_folder_no_reader_sees_and_the_next_save_removes(tmp_path):
    store = _store(tmp_path)
    store.save(1, {"counter": Counter(1)})
    half = store.directory / ".step_00000002.tmp"
    half.mkdir()
    (half / "state.pt").write_bytes(b"half")
    assert store.latest() == store.path_for(1)
    store.save(3, {"counter": Counter(3)})
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000001", "step_00000003"]


def test_a_state_that_is_not_plain_values_is_refused_weights_only(tmp_path):
    store = _store(tmp_path)
    store.save(1, {"thing": {"f": torch.nn.Linear(1, 1)}})  # a module pickles as a class: never unpickled
    with pytest.raises(CorruptCheckpointError, match="weights_only=True"):
        store.load(store.path_for(1), {"thing": None})


@pytest.mark.parametrize("old", ["ckpt", "sim", "sharded"])
def test_an_old_layout_is_refused_in_one_line(tmp_path, old):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    if old == "ckpt":
        (folder / "ckpt_00000004.pt").write_bytes(b"x")
        (folder / "manifest.json").write_text('{"format": 1, "checkpoints": []}')
    elif old == "sim":
        (folder / "step_000004").mkdir()
        (folder / "step_000004" / "engine.json").write_text("{}")
    else:
        (folder / "step_00000004").mkdir()
        (folder / "step_00000004" / "trainer.pt").write_bytes(b"x")
    with pytest.raises(OldLayoutError) as info:
        choose("auto", str(tmp_path / "run"), 0, say=lambda _: None)
    message = str(info.value)
    assert "\n" not in message and "earlier multigpu layout" in message and "new --run-dir" in message
    assert info.value.exit_code == 2


def test_choose_auto_path_and_restart(tmp_path):
    said: list[str] = []
    run = tmp_path / "run"
    assert choose("auto", str(run), 0, say=said.append) is None
    assert said == ["resume=auto: no checkpoint yet; starting from step 0"]
    store = CheckpointStore(run / "checkpoints")
    store.save(2, {"c": Counter(2)})
    store.save(4, {"c": Counter(4)})
    assert choose(None, str(run), 0, say=said.append) is None  # no --resume, first attempt: fresh
    assert choose(None, str(run), 1, say=said.append) == store.path_for(4)  # a restart resumes by itself
    assert said[-1] == f"restart 1: resuming from {store.path_for(4)}"
    assert choose(str(store.path_for(2)), str(run), 0, say=said.append) == store.path_for(2)
    with pytest.raises(ConfigError, match="no such file or folder"):
        choose(str(run / "nope"), str(run), 0, say=said.append)


def test_an_elastic_start_before_any_restart_resumes_from_the_newest_checkpoint(tmp_path):
    """An elastic job (``--nnodes MIN:MAX``) whose worker group torchrun re-forms because a node joined, before any
    failure: the restart count is still 0, and without ``--resume``. It must continue from the run's newest valid
    checkpoint like a restart, not start again from step 0 (the e2e harness always loses a node first, so it never
    saw this). :func:`choose`, :func:`resolve` (the rank entry point's) and :func:`decide` alike."""
    import dataclasses

    from multigpu.checkpoint.resume import decide, resolve
    from multigpu.runtime.context import RunContext

    said: list[str] = []
    run = tmp_path / "run"
    assert choose(None, str(run), 0, say=said.append, elastic=True) is None  # the first start: nothing yet
    assert resolve(None, str(run), restarts=0, elastic=True) is None
    assert said == []
    store = CheckpointStore(run / "checkpoints")
    store.save(3, {"c": Counter(3)})
    store.save(6, {"c": Counter(6)})
    assert choose(None, str(run), 0, say=said.append, elastic=True) == store.path_for(6)
    assert said == [f"elastic start: resuming from {store.path_for(6)}"]
    assert choose(str(store.path_for(3)), str(run), 0, say=said.append, elastic=True) == store.path_for(6)
    assert choose(None, str(run), 0, say=said.append) is None  # not elastic: a first start without --resume
    assert resolve(None, str(run), restarts=0, elastic=True) == store.path_for(6)
    assert resolve(None, str(run), restarts=0) is None
    ctx = RunContext(run_dir=str(run), elastic=True)
    assert decide(ctx).resume_from == str(store.path_for(6))
    assert decide(dataclasses.replace(ctx, elastic=False)).resume_from is None


# ----------------------------------------------------------------------------- rotation and damaged manifests
def _plant(store, name="step_99999999", text="{}"):
    folder = store.directory / name
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(text)
    return folder


def test_rotation_leaves_a_folder_it_does_not_understand_alone_and_names_it_once(tmp_path):
    """A planted ``step_99999999/manifest.json`` of ``{}`` counted as the newest checkpoint: with keep_last=1 every
    real one was deleted as soon as it was written. Only valid checkpoints count, only the store's own are deleted."""
    warnings: list[str] = []
    store = _store(tmp_path, keep_last=1, warnings=warnings)
    store.save(2, {"c": Counter(2)})
    planted = _plant(store)
    odd = _plant(store, "step_00000001", json.dumps({"format": 2, "step": 7, "world_size": 1, "files": {}}))
    store.save(4, {"c": Counter(4)})
    store.save(6, {"c": Counter(6)})
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000001", "step_00000006", "step_99999999"]
    assert (planted / "manifest.json").read_text() == "{}"
    assert len(warnings) == 2, warnings  # each named once, not at every save
    assert any(str(planted) in w and "left alone" in w and "not a format-2 checkpoint manifest" in w for w in warnings)
    assert any(str(odd) in w and "left alone" in w and "records step 7" in w for w in warnings), warnings
    assert store.latest() == store.path_for(6)


def test_rotation_deletes_nothing_until_a_newer_checkpoint_is_valid(tmp_path):
    """Rotation deletes an old checkpoint only once keep_last newer ones verify: a damaged newer one (bytes altered
    on disk after it was written) does not count, and the checkpoint just written is never deleted, even when
    folders of higher steps exist (a run resumed from an earlier step)."""
    store = _store(tmp_path, keep_last=1)
    store.save(2, {"c": Counter(2)})
    other = _store(tmp_path, keep_last=3)
    other.save(8, {"c": Counter(8)})
    state = store.path_for(8) / "state.pt"
    state.write_bytes(state.read_bytes()[:-1] + b"x")  # same size, another checksum
    store.save(4, {"c": Counter(4)})
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000004", "step_00000008"]
    store.save(5, {"c": Counter(5)})  # 5 is valid and newer than 4: now 4 goes; 8 (newer, damaged) stays
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000005", "step_00000008"]
    other.save(9, {"c": Counter(9)})  # keep_last=3: nothing of the others is deleted
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000005", "step_00000008", "step_00000009"]


def test_rotation_with_keep_last_2_does_not_count_a_damaged_newer_checkpoint(tmp_path):
    """keep_last=2, step 2 valid, step 3 damaged on disk, then step 4 saved: step 3 does not verify, so it must not
    count as one of the two kept; step 2 stays and two valid checkpoints remain (4 and 2). A rotation that
    trusted the unverified step 3 deleted step 2 and left one valid checkpoint (keep_last=1 cannot see this: the
    checkpoint just written is always enough there)."""
    store = _store(tmp_path, keep_last=2)
    store.save(2, {"c": Counter(2)})
    store.save(3, {"c": Counter(3)})
    state = store.path_for(3) / "state.pt"
    state.write_bytes(state.read_bytes()[:-1] + bytes([state.read_bytes()[-1] ^ 1]))  # same size, another checksum
    store.save(4, {"c": Counter(4)})
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000002", "step_00000003", "step_00000004"]
    with pytest.raises(CorruptCheckpointError):
        store_module.verify(store.path_for(3))
    store_module.verify(store.path_for(2))  # still whole: a resume past step 4's loss has it
    store.save(5, {"c": Counter(5)})  # 5 and 4 valid and newer: now 2 goes; 3 (damaged, older) goes too
    assert sorted(p.name for p in store.directory.iterdir()) == ["step_00000004", "step_00000005"]


@pytest.mark.parametrize("entry, reason", [
    ({"bytes": "abc", "sha256": "0" * 64}, "records state.pt as"),
    ({"bytes": None, "sha256": "0" * 64}, "records state.pt as"),
    ({"bytes": True, "sha256": "0" * 64}, "records state.pt as"),
    ({"bytes": 10, "sha256": None}, "records state.pt as"),
    ("abc", "records state.pt as"),
])
def test_a_manifest_with_a_malformed_entry_is_skipped_as_unusable(tmp_path, entry, reason):
    """``"bytes": "abc"`` or ``null`` crashed the rank with a TypeError (a string compared with a size)."""
    warnings: list[str] = []
    store = _store(tmp_path, warnings=warnings)
    store.save(2, {"c": Counter(2)})
    store.save(4, {"c": Counter(4)})
    manifest_path = store.path_for(4) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["files"]["state.pt"] = entry
    manifest_path.write_text(json.dumps(manifest))
    assert store.latest() == store.path_for(2)
    assert len(warnings) == 1 and reason in warnings[0] and "unusable" in warnings[0], warnings
    with pytest.raises(CorruptCheckpointError, match=reason):
        check_resume_path(str(store.path_for(4)))


def test_when_every_checkpoint_is_unusable_resume_auto_says_so_with_each_reason(tmp_path):
    """It said "no checkpoint yet" although there were checkpoints, all corrupt."""
    run = tmp_path / "run"
    store = CheckpointStore(run / "checkpoints", keep_last=3)
    store.save(2, {"c": Counter(2)})
    store.save(4, {"c": Counter(4)})
    (store.path_for(2) / "state.pt").write_bytes(b"short")
    manifest_path = store.path_for(4) / "manifest.json"
    manifest_path.write_text(manifest_path.read_text().replace('"bytes": ', '"bytes": "abc", "was": '))
    scan = store.scan()
    assert scan.found is None
    assert [(p.name, "truncated" in why or "records state.pt as" in why) for p, why in scan.unusable] == [
        ("step_00000004", True), ("step_00000002", True)]
    said: list[str] = []
    with pytest.raises(ConfigError) as info:  # never a quiet start from step 0 over them
        choose("auto", str(run), 0, say=said.append)
    message = str(info.value)
    assert said == [] and "\n" not in message, (said, message)
    assert message.startswith(f"--resume auto: {store.directory} holds 2 checkpoint folder(s) and none can be "
                              "used ("), message
    assert "step_00000004: its manifest.json records state.pt as" in message
    assert "step_00000002: state.pt is truncated" in message

# ----------------------------------------------------------------------------- on 2 ranks
class Shards:
    """A 'sharded' part: each rank holds a DTensor shard of one global vector."""

    def __init__(self, n, fill):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        import multigpu as mg

        mesh = init_device_mesh("cpu", (mg.world_size(),))
        per = n // mg.world_size()
        local = torch.arange(mg.rank() * per, (mg.rank() + 1) * per, dtype=torch.float32) * fill
        self.vec = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    def state_dict(self):
        return {"vec": self.vec}

    def load_state_dict(self, state):
        self.vec = state["vec"]


def _save_on_ranks(directory):
    import multigpu as mg

    store = CheckpointStore(directory, keep_last=1)
    path = store.save(5, {"shards": Sharded(Shards(8, 2.0)), "mine": PerRank(Counter(10 + mg.rank())),
                          "common": Counter(7)})
    return sorted(p.name for p in path.iterdir())


def _load_on_ranks(directory):
    import multigpu as mg

    store = CheckpointStore(directory)
    shards, mine, common = Shards(8, 0.0), Counter(), Counter()
    loaded = store.load(store.latest(), {"shards": Sharded(shards), "mine": PerRank(mine), "common": common})
    return mg.rank(), shards.vec.full_tensor().tolist(), mine.value, common.value, loaded["_manifest"]["world_size"]


@pytest.mark.dist
def test_sharded_and_per_rank_parts_on_two_ranks(tmp_path):
    names = run_on_ranks(_save_on_ranks, 2, args=(str(tmp_path / "c"),), timeout_s=120)
    assert names[0] == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "state.pt"]
    results = run_on_ranks(_load_on_ranks, 2, args=(str(tmp_path / "c"),), timeout_s=120)
    for rank, vec, mine, common, world in results:
        assert vec == [2.0 * i for i in range(8)] and mine == 10 + rank and common == 7 and world == 2


def test_the_simulation_keeps_only_its_last_checkpoints(tmp_path):
    """sim kept every checkpoint (and filled a disk): it rotates like every workload now (keep_last)."""
    import multigpu as mg
    from multigpu.config import load_config
    from multigpu.run import script_context
    from multigpu.sim import runner
    from multigpu.sim.config import SimConfig

    mg.init(backend="cpu", threads=1)
    cfg = load_config(SimConfig, "sir", ["steps=8", "agents=2000", "grid=[32,32]", "compile=false", "plot=false",
                                         "checkpoint_every=2", "keep_last=2"], prefix="sim")
    runner.run(cfg, script_context(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step_00000006", "step_00000008"]


def test_the_simulations_series_so_far_are_checksummed_with_its_checkpoint(tmp_path):
    """Issue 48: the series a resumed simulation continues (every step's aggregates so far) lived in manifest.json's
    meta, outside every checksum: a digit flipped there reached series.csv. They are in state.pt now, whose size and
    SHA-256 the manifest records: what the manifest still says of the series is nothing, and a flipped byte of
    state.pt is refused, naming the file."""
    import json

    import multigpu as mg
    from multigpu.config import load_config
    from multigpu.errors import CorruptCheckpointError
    from multigpu.run import script_context
    from multigpu.sim import runner
    from multigpu.sim.config import SimConfig

    mg.init(backend="cpu", threads=1)
    settings = ["agents=2000", "grid=[32,32]", "compile=false", "plot=false", "checkpoint_every=3", "keep_last=3"]
    whole = runner.run(load_config(SimConfig, "sir", ["steps=6", *settings], prefix="sim"))
    cfg = load_config(SimConfig, "sir", ["steps=3", *settings], prefix="sim")
    runner.run(cfg, script_context(tmp_path / "run"))
    step = tmp_path / "run" / "checkpoints" / "step_00000003"
    manifest = json.loads((step / "manifest.json").read_text())
    meta = manifest["meta"]
    if "history" in meta:  # a digit of the infected count at step 2 changed where no checksum looks
        meta["history"]["I"][1] += 9000
        (step / "manifest.json").write_text(json.dumps(manifest))
    resumed = runner.run(load_config(SimConfig, "sir", ["steps=6", *settings], prefix="sim"),
                         script_context(tmp_path / "run", resume="auto"))
    assert resumed.series == whole.series
    assert not {"history", "env", "rebalances"} & set(meta), sorted(meta)
    data = bytearray((step / "state.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (step / "state.pt").write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="state.pt"):
        runner.run(load_config(SimConfig, "sir", ["steps=6", *settings], prefix="sim"),
                   script_context(tmp_path / "run", resume=str(step)))


def test_a_fingerprint_with_nan_is_never_called_equal_let_alone_bit_exact():
    """Issue 48: a NaN in the saved (or loaded) fingerprint made the resize check say "bit for bit" (max() of 0.0
    and NaN is 0.0). A NaN sum cannot show the state is the one saved."""
    from multigpu.checkpoint.resize import compare

    nan, inf = float("nan"), float("inf")
    for saved, loaded in (([nan, 1.0], [1.0, 1.0]), ([1.0, 1.0], [nan, 1.0]), ([nan, 1.0], [nan, 1.0]),
                          ([inf, 1.0], [1.0, 1.0])):
        check = compare({"model": saved}, {"model": loaded})
        assert not check["equal"] and not check["bit_exact"], (saved, loaded, check)
    assert compare({"model": [inf, 2.0]}, {"model": [inf, 2.0]})["bit_exact"]  # the same infinity: the same sum
