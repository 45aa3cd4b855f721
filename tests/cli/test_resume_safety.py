"""A resume never quietly loses the run: unusable checkpoints stop it, another world size keeps the global batch.

Pins what happened on two loopback nodes without a shared run folder: the FSDP checkpoints were unusable (a
shard listed in the manifest was in the other node's folder), and ``--resume auto`` skipped them and started
again from step 0, printing "done"; the run then resumed on 1 rank with half the global batch and no word.
Nothing here spawns a rank (torch's launcher is mocked), except where a rank-side choice is checked directly.
"""

from __future__ import annotations

import json

import pytest
import torch

from multigpu.checkpoint.store import CheckpointStore
from multigpu.cli import main
from multigpu.errors import ConfigError


@pytest.fixture
def launched(monkeypatch, fake_gpus):
    """torch's launcher replaced by a recorder (the run's run.json is on disk)."""
    fake_gpus(0)
    seen: list[str] = []
    monkeypatch.setattr("multigpu.launch.agent._elastic_launch", lambda config, entry, args: seen.append(entry))
    return seen


def _checkpoints(run, steps=(2, 4)):
    store = CheckpointStore(run / "checkpoints")
    for step in steps:
        store.save(step, {"progress": {"step": step}, "weights": torch.arange(8.0) * step})
    return store


def _break(store, how: str) -> None:
    newest, older = store.folders()[-1], store.folders()[0]
    if how == "a listed file missing":  # what a shard in the other node's folder looked like
        (newest / "state.pt").unlink()
        (older / "manifest.json").write_text("{not json")
    else:  # altered after it was written: passes the launcher's cheap check, not the ranks' checksums
        for folder in (newest, older):
            data = bytearray((folder / "state.pt").read_bytes())
            data[-1] ^= 0xFF
            (folder / "state.pt").write_bytes(bytes(data))


def test_resume_auto_over_checkpoints_none_of_which_can_be_used_stops_in_one_line(tmp_path, launched, capsys):
    run = tmp_path / "run"
    _break(_checkpoints(run), "a listed file missing")
    assert main(["sim", "--run-dir", str(run), "--resume", "auto"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: --resume auto: {run / 'checkpoints'} holds 2 checkpoint "
                                              "folder(s) and none can be used (step_00000004: "), err
    assert "step_00000004: state.pt is missing" in err and "does not start again from step 0" in err
    assert not launched and not (run / "run.json").exists()  # nothing started, nothing written


@pytest.mark.parametrize("restarts", [0, 1])
def test_the_rank_that_picks_the_checkpoint_refuses_too_where_only_checksums_fail(tmp_path, restarts):
    from multigpu.checkpoint.resume import choose, refuse_unusable

    run = tmp_path / "run"
    _break(_checkpoints(run), "altered bytes")
    refuse_unusable(run)  # the launcher's check reads no bytes: it lets these through, to the ranks
    said: list[str] = []
    with pytest.raises(ConfigError) as info:
        choose("auto" if restarts == 0 else None, str(run), restarts, say=said.append)
    message = str(info.value)
    why = "--resume auto" if restarts == 0 else f"restart {restarts}"
    assert message.startswith(f"{why}: {run / 'checkpoints'} holds 2 checkpoint folder(s) and none can be used")
    assert "checksum mismatch" in message and not any("starting from step 0" in line for line in said)


def _tiny_train_run(run, *, world_size: int, batch_size: int, grad_accum: int) -> None:
    """A train run's folder as a job of ``world_size`` ranks leaves it: run.json, and a checkpoint of step 2 whose
    manifest records that world size and its global batch."""
    from multigpu.config import from_dict, to_dict
    from multigpu.train.checkpoint import param_shapes
    from multigpu.train.job import TrainJobConfig, _planned_context

    cfg = from_dict(TrainJobConfig, {**_TINY_CONFIG, "batch_size": batch_size, "grad_accum": grad_accum})
    model = cfg.model.build("model.factory", _planned_context(cfg))  # the default data's vocabulary
    state = model.state_dict()
    store = CheckpointStore(run / "checkpoints")
    global_batch = batch_size * grad_accum * world_size
    path = store.save(2, {"model": state, "trainer": {"step": 2}},
                      meta={"params": param_shapes(state), "global_batch": global_batch})
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps({**manifest, "world_size": world_size}))  # not checksummed
    (run / "run.json").write_text(json.dumps({"workload": "train", "config": to_dict(cfg), "run": {}}))


_TINY_CONFIG = {"model": {"factory": "multigpu.train.nano:gpt", "kwargs": {"n_layer": 1, "n_head": 2, "n_embd": 16}},
                "block_size": 16, "steps": 4, "eval_every": 0, "sample_chars": 0, "logger": []}


def test_a_resume_at_another_world_size_keeps_the_global_batch_or_refuses_unless_asked(tmp_path, launched, capsys):
    run = tmp_path / "run"
    run.mkdir()
    _tiny_train_run(run, world_size=2, batch_size=4, grad_accum=1)  # 8 samples per step
    base = ["train", "--run-dir", str(run), "--resume", "auto", "--cpu"]

    assert main([*base, "--nproc-per-node", "1"]) == 0  # 1 rank: accumulate 2 micro-batches
    out = capsys.readouterr().out
    assert ("multigpu train: resuming a checkpoint written by 2 rank(s) on 1 rank(s): grad_accum 1 -> 2 keeps the "
            "global batch of 8 samples per step") in out
    assert json.loads((run / "run.json").read_text())["config"]["grad_accum"] == 2

    _tiny_train_run(run, world_size=2, batch_size=4, grad_accum=1)
    assert main([*base, "--nproc-per-node", "3"]) == 2  # 8 samples do not split over 3 ranks of 4
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: --resume: the checkpoint was written by 2 rank(s) with a global "
                                              "batch of 8 samples per step, which 3 rank(s) of batch 4 cannot keep")
    assert len(launched) == 1

    assert main([*base, "--nproc-per-node", "3", "batch_size=2"]) == 0  # asked: 2 × 3 = 6 samples
    assert ("the global batch changes from 8 to 6 samples per step, as asked (batch_size given here)"
            in capsys.readouterr().out)
    _tiny_train_run(run, world_size=2, batch_size=4, grad_accum=1)
    assert main([*base, "--nproc-per-node", "2"]) == 0  # the same world size: nothing to say
    assert "resuming a checkpoint written by" not in capsys.readouterr().out


def test_the_resume_command_is_the_whole_command(tmp_path):
    from multigpu.jobs.command import resume_command

    run = tmp_path / "run"
    argv = ["train", "-f", "nano", "--nproc-per-node", "2", "--run-dir", "old", "--resume=x", "logger=[]"]
    assert resume_command(argv, run, 1) == (f"multigpu train -f nano --nproc-per-node 2 'logger=[]' --run-dir {run} "
                                            "--resume auto")
    nodes = ["train", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "n0:29400", "--cpu"]
    assert resume_command(nodes, run, 2) == (f"multigpu train --nnodes 2 --rdzv-endpoint n0:29400 --cpu --run-dir "
                                             f"{run} --resume auto (on every node, each with its --node-rank)")


def test_a_resume_at_another_world_size_says_so_in_one_line_for_every_workload(tmp_path, launched, capsys):
    """A sim checkpoint written by 2 ranks resumed on 1, and a 2-rank ensemble continued on 1 (its progress is
    files, not a checkpoint: the run's last launch says its size): each ran on the other size without a word (the
    ensemble took 222 s instead of ~30). One line says so now; at the same size, nothing."""
    sim = tmp_path / "sim"
    sim.mkdir()
    store = CheckpointStore(sim / "checkpoints")
    store.save(2, {"progress": {"step": 2}})
    manifest = store.folders()[-1] / "manifest.json"
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, "world_size": 2}))  # as 2 ranks wrote it
    (sim / "run.json").write_text(json.dumps({"workload": "sim", "config": {"agents": 4000, "steps": 4}}))
    assert main(["sim", "--run-dir", str(sim), "--resume", "auto", "--cpu", "--nproc-per-node", "1"]) == 0
    out = capsys.readouterr().out
    line = ("multigpu sim: resuming a run of 2 rank(s) on 1 rank(s) (--nproc-per-node 2 runs it at the size it "
            "ran)")
    assert out.count(line) == 1, out

    ensemble = tmp_path / "ensemble"
    assert main(["sim", "--run-dir", str(ensemble), "--replicates", "4", "--agents", "2000", "--steps", "2",
                 "--cpu", "--nproc-per-node", "2"]) == 0
    assert json.loads((ensemble / "run.json").read_text())["world_size"] == 2
    (ensemble / "ensemble").mkdir(exist_ok=True)
    capsys.readouterr()
    assert main(["sim", "--run-dir", str(ensemble), "--resume", "auto", "--cpu", "--nproc-per-node", "1"]) == 0
    assert line in capsys.readouterr().out
    assert main(["sim", "--run-dir", str(ensemble), "--resume", "auto", "--cpu", "--nproc-per-node", "1"]) == 0
    assert "resuming a run of" not in capsys.readouterr().out  # the last launch was at 1 rank


def test_a_resume_that_rewinds_its_own_run_sets_the_later_checkpoints_aside(tmp_path, launched, capsys):
    """Issue 48: `--resume RUN/checkpoints/step_2` of a run that went on to steps 4 and 6 started a second branch
    beside the first: `--resume auto` then continued the older, higher one, and keep_last deleted the new steps
    (the old higher ones counted as newer). The later checkpoints are set aside now (moved, never deleted), said
    in one line; the run's checkpoints are the new branch's."""
    run = tmp_path / "run"
    _checkpoints(run, steps=(2, 4, 6))
    assert main(["sim", "--run-dir", str(run), "--resume", str(run / "checkpoints" / "step_00000002")]) == 0
    out = capsys.readouterr().out
    [aside] = [p for p in (run / "checkpoints").iterdir() if not p.name.startswith("step_")]
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_00000002"]
    assert sorted(p.name for p in aside.iterdir()) == ["step_00000004", "step_00000006"]
    assert (f"multigpu sim: resuming {run / 'checkpoints' / 'step_00000002'} rewinds this run: its later "
            f"checkpoints (step_00000004, step_00000006) are set aside in {aside}") in out, out
    assert len(launched) == 1
