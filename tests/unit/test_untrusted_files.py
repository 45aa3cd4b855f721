"""Loading a checkpoint or a result never runs code from the file (issue 16, item 1).

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
from multigpu import verify
from multigpu.checkpointing import CorruptCheckpointError
from multigpu.cli import main
from multigpu.config import load_config
from multigpu.errors import MultigpuError
from multigpu.sim import checkpoint as sim_checkpoint
from multigpu.sim import runner
from multigpu.sim.config import SimConfig
from multigpu.train import CheckpointManager
from multigpu.train.checkpoint import capture_rng, restore_rng
from tests.payloads import TouchOnLoad, evil_checkpoint, evil_sim_checkpoint, list_in_manifest

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
    torch.load(evil_checkpoint(tmp_path / "evil.pt", marker), weights_only=False)
    assert marker.exists()
    marker.unlink()
    pickle.loads((evil_sim_checkpoint(tmp_path / "step_000004", marker) / ".metadata").read_bytes())
    assert marker.exists()


# ------------------------------------------------------------------ training


@pytest.mark.parametrize("where", ["alone", "beside_a_manifest"])
def test_train_resume_evil_file_is_one_line_exit_2_and_never_unpickled(tmp_path, capsys, no_launch, where):
    """The launcher's pre-check reads bytes only: an unlisted file is refused before anything runs."""
    marker = tmp_path / "ran"
    folder = tmp_path / "old" / "checkpoints"
    if where == "beside_a_manifest":
        mg.init(backend="cpu", threads=1)
        CheckpointManager(folder).save({"step": 2, "model": {"w": torch.ones(2)}, "optimizer": {}})
    evil = evil_checkpoint(folder / "evil.pt", marker)
    run_dir = tmp_path / "run"
    capsys.readouterr()
    code = main(["train", "-f", NANO, "--run-dir", str(run_dir), "--resume", str(evil)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"error: --resume {evil}: it is not listed in {folder / 'manifest.json'}")
    assert "is not loaded" in err
    assert not marker.exists() and not run_dir.exists()


def test_resume_auto_ignores_a_planted_unlisted_checkpoint_with_a_warning(tmp_path, multigpu_warnings):
    mg.init(backend="cpu", threads=1)
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save({"step": 2, "model": {"w": torch.ones(2)}, "optimizer": {}})
    marker = tmp_path / "ran"
    planted = evil_checkpoint(manager.path_for(99999999), marker)
    assert manager.resolve("auto") == manager.path_for(2)
    assert len(multigpu_warnings) == 1, multigpu_warnings
    assert str(planted) in multigpu_warnings[0] and "is not listed in" in multigpu_warnings[0]
    assert "not loaded" in multigpu_warnings[0]
    assert not marker.exists()
    assert manager.load(manager.path_for(2))["step"] == 2


def test_a_file_listed_by_a_forged_manifest_is_still_loaded_weights_only(tmp_path):
    """A checksum shows a file is unchanged, not that it is safe: the load itself refuses the payload."""
    mg.init(backend="cpu", threads=1)
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save({"step": 2, "model": {"w": torch.ones(2)}, "optimizer": {}})
    marker = tmp_path / "ran"
    evil = evil_checkpoint(manager.path_for(99999999), marker)
    list_in_manifest(evil)
    assert manager.resolve(str(evil)) == evil  # size and SHA-256 match what the manifest says
    with pytest.raises(CorruptCheckpointError) as info:
        manager.load(evil)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"checkpoint {evil} is unusable: it refers to ")
    assert "Path.touch" in message or "getattr" in message, message
    assert "weights_only=True" in message
    assert manager.resolve("auto") == manager.path_for(2)  # auto skips it (it does not load) for the valid one
    assert not marker.exists()


def test_new_checkpoints_need_no_allow_list_and_old_ones_still_resume(tmp_path):
    """What is saved is tensors and plain values (the NumPy RNG key as a tensor); a checkpoint written
    before that, with NumPy's ndarray inside, still loads (NumPy's array type allowed for that load only)."""
    mg.init(backend="cpu", threads=1)
    manager = CheckpointManager(tmp_path / "checkpoints")
    path = manager.save({"step": 2, "model": {"w": torch.ones(2)}, "optimizer": {}, "sampler": {"epoch": 0}})
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    np.random.seed(7)
    expected = np.random.rand(3)
    np.random.seed(7)
    legacy = {"python": capture_rng()["python"], "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    manager.folder.save(4, lambda fh: torch.save({"step": 4, "model": {}, "optimizer": {}, "rng": [legacy]}, fh))
    assert torch.serialization.get_unsafe_globals_in_checkpoint(manager.path_for(4))  # ndarray, dtype, ...
    state = manager.load(manager.resolve("auto"))
    np.random.seed(0)
    restore_rng(state["rng"][0])
    assert np.array_equal(np.random.rand(3), expected)
    with pytest.raises(pickle.UnpicklingError):  # the allow-list was scoped to that load
        torch.load(manager.path_for(4), weights_only=True)


# ------------------------------------------------------------------ simulation


@pytest.mark.parametrize("checksum, reason", [
    ("none", "records no SHA-256 of .metadata"),
    ("stale", ".metadata does not match engine.json"),
])
def test_sim_resume_crafted_metadata_is_one_line_exit_2_and_never_unpickled(tmp_path, capsys, no_launch, checksum,
                                                                           reason):
    marker = tmp_path / "ran"
    crafted = evil_sim_checkpoint(tmp_path / "step_000004", marker, checksum=checksum)
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
    """Whoever wrote the whole folder can forge engine.json's checksum: the ranks' restricted
    unpickler still builds only DCP's metadata classes, and resume=auto skips a tampered checkpoint."""
    mg.init(backend="cpu", threads=1)
    run_dir = tmp_path / "run"
    runner.run(_small_sim(4), run_dir=run_dir, progress=False)
    ckpts = run_dir / "checkpoints"
    meta = json.loads((ckpts / "step_000004" / "engine.json").read_text())
    assert set(meta["checksums"]) == {".metadata"}

    marker = tmp_path / "ran"
    forged = evil_sim_checkpoint(tmp_path / "forged" / "step_000004", marker, checksum="forged")
    sim_checkpoint.check_checkpoint(forged)  # the checksum matches: the launcher would let it through
    with pytest.raises(CorruptCheckpointError) as info:
        runner.run(_small_sim(6), run_dir=tmp_path / "run2", resume=str(forged), progress=False)
    message = str(info.value)
    assert "\n" not in message and str(forged) in message, message
    assert "global pathlib.Path.touch is not allowed" in message and "nothing in it ran" in message

    # the newest checkpoint of a known run altered: auto names it, skips it, and takes the previous one
    newest = ckpts / "step_000004" / ".metadata"
    newest.write_bytes(pickle.dumps(TouchOnLoad(marker)))
    result = runner.run(_small_sim(6), run_dir=run_dir, resume="auto", progress=False)
    assert result.summary["resumed_from"] == str(ckpts / "step_000002")
    assert len(multigpu_warnings) == 1 and "step_000004" in multigpu_warnings[0], multigpu_warnings
    assert ".metadata does not match engine.json" in multigpu_warnings[0]
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
