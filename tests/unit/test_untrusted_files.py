"""Loading a checkpoint or a result never runs code from the file.

These pin the fix for: ``multigpu train --resume evil.pt`` running a pickled
``os.system`` three times (the launcher's "does it load" pre-check, then rank 0
twice); a planted ``ckpt_99999999.pt`` that the manifest does not list being
used by ``--resume auto`` because "it loads"; ``multigpu sim --resume DIR``
handing a crafted DCP ``.metadata`` to ``pickle.load``; and ``verify`` reading
results with ``weights_only=False``. Every payload here would create a marker
file; each test checks the marker is absent and the error is one line naming
the file. The first test shows the payload really runs under plain pickle.
"""

from __future__ import annotations

import json
import logging
import pickle
from unittest import mock

import numpy as np
import pytest
import torch

import multigpu as mg
from multigpu import checkpoint, verify
from multigpu.checkpoint import CheckpointStore, PerRank, RngState, check_resume_path
from multigpu.cli import main
from multigpu.config import load_config
from multigpu.errors import CorruptCheckpointError, MultigpuError
from multigpu.run import script_context
from multigpu.sim import runner
from multigpu.sim.config import SimConfig
from tests.payloads import TouchOnLoad, evil_checkpoint, evil_sim_checkpoint

NANO = "nano"
SIR = "sir"


@pytest.fixture
def no_launch(monkeypatch, fake_gpus):
    """torch's launcher replaced by a tripwire: these commands must stop before spawning a rank."""
    fake_gpus(0)
    monkeypatch.setattr("multigpu.launch.agent._elastic_launch",
                        mock.Mock(side_effect=AssertionError("the bad checkpoint reached torch's launcher")))


@pytest.fixture
def multigpu_warnings():
    """The messages of warnings logged through ``mg.get_logger()`` during the test."""
    messages: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                messages.append(record.getMessage())

    logger = mg.get_logger()
    handler = _Collect()
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def test_the_payload_really_runs_under_plain_pickle(tmp_path):
    """The control: without the fix, each of these files runs its payload."""
    marker = tmp_path / "ran"
    torch.load(evil_checkpoint(tmp_path / "evil", marker) / "state.pt", weights_only=False)
    assert marker.exists()
    marker.unlink()
    pickle.loads((evil_sim_checkpoint(tmp_path / "step_00000004", marker) / ".metadata").read_bytes())
    assert marker.exists()


# ------------------------------------------------------------------ training


@pytest.mark.parametrize("where", ["alone", "inside_a_checkpoint"])
def test_train_resume_evil_file_is_one_line_exit_2_and_never_unpickled(tmp_path, capsys, no_launch, where):
    """The launcher's pre-check reads bytes only: a folder without a manifest, or a file its manifest does not
    list, is refused before anything runs."""
    marker = tmp_path / "ran"
    folder = tmp_path / "old" / "checkpoints"
    if where == "inside_a_checkpoint":
        mg.init(backend="cpu", threads=1)
        good = CheckpointStore(folder).save(2, {"model": {"w": torch.ones(2)}, "optimizer": {}})
        evil = good
        torch.save({"w": TouchOnLoad(marker)}, good / "evil.pt")
        reason = "evil.pt is not listed in its manifest.json"
    else:
        evil = evil_checkpoint(folder / "step_00000099", marker)
        reason = "not a checkpoint folder (it has no manifest.json"
    run_dir = tmp_path / "run"
    capsys.readouterr()
    code = main(["train", "-f", NANO, "--run-dir", str(run_dir), "--resume", str(evil)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"error: --resume {evil}: ") and reason in err, err
    assert "not loaded" in err
    assert not marker.exists() and not run_dir.exists()


def test_resume_auto_ignores_a_planted_unlisted_checkpoint_with_a_warning(tmp_path, multigpu_warnings):
    mg.init(backend="cpu", threads=1)
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save(2, {"model": {"w": torch.ones(2)}, "optimizer": {}})
    marker = tmp_path / "ran"
    planted = evil_checkpoint(store.path_for(99999999), marker)
    assert store.latest() == store.path_for(2)
    assert len(multigpu_warnings) == 1, multigpu_warnings
    assert str(planted) in multigpu_warnings[0] and "no manifest.json" in multigpu_warnings[0]
    assert not marker.exists()
    assert store.load(store.path_for(2), {"model": None})["model"]["w"].tolist() == [1.0, 1.0]


def test_a_file_listed_by_a_forged_manifest_is_still_refused_unpickled(tmp_path, multigpu_warnings):
    """A checksum shows a file is unchanged, not that it is safe: the globals it names are read from its opcodes
    (nothing unpickled) and refused, by the launcher's check, by resume=auto and by the load itself."""
    mg.init(backend="cpu", threads=1)
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save(2, {"model": {"w": torch.ones(2)}, "optimizer": {}})
    marker = tmp_path / "ran"
    evil = evil_checkpoint(store.path_for(99999999), marker, listed=True)
    for attempt in (lambda: check_resume_path(str(evil)), lambda: store.load(evil, {"model": None})):
        with pytest.raises(CorruptCheckpointError) as info:
            attempt()
        message = str(info.value)
        assert "\n" not in message and message.startswith(f"checkpoint {evil / 'state.pt'} is unusable: it refers to ")
        assert "pathlib.Path" in message, message  # the global its payload calls, named without unpickling
        assert "weights_only=True" in message
    assert store.latest() == store.path_for(2)  # auto skips it (named in a warning) for the valid one
    assert len(multigpu_warnings) == 1 and "it refers to" in multigpu_warnings[0], multigpu_warnings
    assert not marker.exists()


def test_new_checkpoints_need_no_allow_list_and_restore_every_random_stream(tmp_path):
    """What is saved is tensors and plain values (the NumPy RNG key as a tensor): nothing to allow-list."""
    mg.init(backend="cpu", threads=1)
    store = CheckpointStore(tmp_path / "checkpoints")
    np.random.seed(7)
    path = store.save(2, {"model": {"w": torch.ones(2)}, "rng": PerRank(RngState()), "sampler": {"epoch": 0}})
    expected = np.random.rand(3)
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path / "state.pt") == []
    np.random.seed(0)
    store.load(path, {"rng": PerRank(RngState())})
    assert np.array_equal(np.random.rand(3), expected)


# ------------------------------------------------------------------ simulation


@pytest.mark.parametrize("checksum, reason", [
    ("none", ".metadata is not listed in its manifest.json"),
    ("stale", ".metadata: checksum mismatch"),
])
def test_sim_resume_crafted_metadata_is_one_line_exit_2_and_never_unpickled(tmp_path, capsys, no_launch, checksum,
                                                                           reason):
    marker = tmp_path / "ran"
    crafted = evil_sim_checkpoint(tmp_path / "step_00000004", marker, checksum=checksum)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    code = main(["sim", "-f", SIR, "--run-dir", str(run_dir), "--resume", str(crafted)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"error: --resume {crafted}: ") and reason in err
    assert not marker.exists() and not run_dir.exists()


def _small_sim(steps: int):
    return load_config(SimConfig, SIR, [f"steps={steps}", "agents=2000", "grid=[32,32]", "compile=false",
                                        "checkpoint_every=2"], prefix="sim")


def test_sim_ranks_refuse_crafted_metadata_even_with_a_matching_checksum(tmp_path, multigpu_warnings):
    """Whoever wrote the whole folder can forge the manifest's checksum: the ranks' restricted
    unpickler still builds only DCP's metadata classes, and resume=auto skips a tampered checkpoint."""
    mg.init(backend="cpu", threads=1)
    run_dir = tmp_path / "run"
    runner.run(_small_sim(4), script_context(run_dir))
    ckpts = run_dir / "checkpoints"
    meta = json.loads((ckpts / "step_00000004" / "manifest.json").read_text())
    assert ".metadata" in meta["files"] and meta["meta"]["step"] == 4

    marker = tmp_path / "ran"
    forged = evil_sim_checkpoint(tmp_path / "forged" / "step_00000004", marker, checksum="forged")
    checkpoint.verify(forged)  # the checksum matches: the launcher would let it through
    with pytest.raises(CorruptCheckpointError) as info:
        runner.run(_small_sim(6), script_context(tmp_path / "run2", resume=str(forged)))
    message = str(info.value)
    assert "\n" not in message and str(forged) in message, message
    assert "global pathlib.Path.touch is not allowed" in message and "nothing in it ran" in message

    # the newest checkpoint of a known run altered: auto names it, skips it, and takes the previous one
    newest = ckpts / "step_00000004" / ".metadata"
    newest.write_bytes(pickle.dumps(TouchOnLoad(marker)))
    result = runner.run(_small_sim(6), script_context(run_dir, resume="auto"))
    assert result.summary["resumed_from"] == str(ckpts / "step_00000002")
    assert len(multigpu_warnings) == 1 and "step_00000004" in multigpu_warnings[0], multigpu_warnings
    assert ".metadata is truncated" in multigpu_warnings[0]  # the payload is shorter than what was written
    assert not marker.exists()


# ------------------------------------------------------------------ verify results


def test_verify_results_are_read_weights_only(tmp_path, monkeypatch):
    marker = tmp_path / "ran"
    torch.save({"value": TouchOnLoad(marker)}, tmp_path / "evil.pt")
    with pytest.raises(MultigpuError) as info:
        verify.load_results(tmp_path)
    assert str(info.value).startswith(f"verify result {tmp_path / 'evil.pt'} holds something other than tensors")
    assert "\n" not in str(info.value) and not marker.exists()

    monkeypatch.setattr(verify, "_RECORDED", set())
    from multigpu.runtime import context

    context.set_current(context.RunContext(verify_dir=str(tmp_path / "results")))
    with pytest.raises(ValueError, match=r"verify.record\('odd'\) got a TouchOnLoad"):
        mg.verify.record("odd", {"x": TouchOnLoad(marker)})
    mg.verify.record("fine", {"loss": 0.5, "names": ["a", "b"], "t": torch.ones(2), "none": None})
    assert verify.load_results(tmp_path / "results")["fine"]["names"] == ["a", "b"]
