"""Experiment tracking in `multigpu train`: `logger: wandb` on rank 0, read back from wandb's own files.

W&B runs offline here (``WANDB_MODE=offline``): everything the run logged lands in one ``run-<id>.wandb`` file
inside the run directory. wandb 0.31 has no Python reader for it (its Go core reads it), so ``_wandb_records``
reads the framing (LevelDB's log format: 32 KiB blocks, 7-byte record headers) and parses each record with
wandb's own protobuf classes. The tests then hold what W&B got against what ``metrics.jsonl`` holds.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from tests.cli.test_train_byo import COMMON, ENV, HERE
from tests.conftest import assert_bad_input, run_cli

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _wandb_records(path: Path) -> list:
    """Every record of a ``run-<id>.wandb`` file, as ``wandb_internal_pb2.Record`` objects, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, pos = [], b"", 7  # header: ':W&B', magic 0xBEE1, version
    while pos + 7 <= len(data):
        room = _BLOCK - pos % _BLOCK
        if room < 7:  # the rest of a block too short for a header is padding
            pos += room
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0:  # zero padding at the end of the file
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _items(items) -> dict:
    """``{key: value}`` of history/config/summary items (a key is ``key``, or ``nested_key``'s parts joined)."""
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}


def _read_run(run_dir: Path) -> dict:
    """What the W&B run(s) in ``run_dir/wandb`` got: run ids, config, history by step, summary, exit codes."""
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    out: dict = {"files": files, "ids": [], "names": [], "config": {}, "history": {}, "summary": {}, "exit": []}
    for path in files:
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                out["ids"].append(rec.run.run_id)
                out["names"].append(rec.run.display_name)
                out["config"].update(_items(rec.run.config.update))
            elif kind == "config":
                out["config"].update(_items(rec.config.update))
            elif kind == "history":
                out["history"][rec.history.step.num] = _items(rec.history.item)
            elif kind == "summary":
                out["summary"].update(_items(rec.summary.update))
            elif kind == "exit":
                out["exit"].append(rec.exit.exit_code)
    return out


@pytest.mark.e2e
def test_wandb_offline_on_two_ranks_logs_the_config_every_metric_and_the_summary_once(tmp_path):
    """Rank 0 alone opens one W&B run, named after the run directory, with its files inside it; the run holds
    the resolved config, every metrics.jsonl record at its step (the same values), the summary, exit code 0."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'multigpu[tracking]')")
    run_dir = tmp_path / "tracked"
    proc = run_cli("train", "--model", f"{HERE}:make_model", "model.kwargs.width=16", "--data", f"{HERE}:make_data",
                   "--loss", f"{HERE}:mse", "unit=samples", "steps=6", "global_batch_size=16", "lr=0.05",
                   "checkpoint_every=0", *COMMON, "log_every=2", "eval_every=3", "--logger", "wandb",
                   "wandb.project=tracking-test", "--nproc-per-node", "2", "--run-dir", str(run_dir),
                   env={**ENV, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = _read_run(run_dir)
    assert len(got["files"]) == 1, got["files"]  # rank 0 only: one run
    assert got["names"] == ["tracked"] and (run_dir / "wandb" / "run_id").read_text() == got["ids"][0]
    assert got["config"]["steps"] == 6 and got["config"]["logger"] == ["wandb"] and got["config"]["world_size"] == 2
    assert got["config"]["model"]["factory"] == f"{HERE}:make_model" and got["config"]["effective_batch"] == 16

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == sorted(got["history"]) == [2, 3, 4, 6]  # log_every 2, eval at 3 and 6
    for record in records:
        logged = got["history"][record["step"]]
        for key, value in record.items():
            if key != "step" and value is not None:
                assert logged[key] == pytest.approx(value, rel=1e-12), (record["step"], key)
    assert got["history"][6]["loss"] == records[-1]["loss"] and "val_loss" in got["history"][3]

    summary = json.loads((run_dir / "summary.json").read_text())
    assert got["summary"]["final_step"] == summary["final_step"] == 6
    assert got["summary"]["throughput"] == pytest.approx(summary["throughput"])
    assert got["exit"] == [0]


class _FailingLoss:
    """MSE that raises at its 5th call (step 5): a user's bug in the middle of a run."""

    def __init__(self):
        self.calls = 0

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls == 5:
            raise RuntimeError("boom at step 5")
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def test_a_failing_run_finishes_its_wandb_run_as_failed_and_a_resume_continues_it(tmp_path, monkeypatch):
    """An exception in the loop finishes the W&B run with exit code 1 (not "running" forever); ``--resume``
    continues the same W&B run id (kept in wandb/run_id) from the checkpoint, and a new run gets a new id."""
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install 'multigpu[tracking]')")
    import dataclasses

    import multigpu as mg
    from multigpu.train import TrainConfig, Trainer, make_optimizer
    from tests.cli.test_train_byo import make_data, make_model

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    mg.init()
    cfg = TrainConfig(steps=6, batch_size=8, lr=0.01, warmup_steps=1, eval_every=0, log_every=2, checkpoint_every=2,
                      prefetch=0, logger=["jsonl", "wandb"])
    cfg = dataclasses.replace(cfg, wandb=dataclasses.replace(cfg.wandb, mode="offline", project="t"))
    run_dir = tmp_path / "run"

    def trainer(loss, **kwargs):
        torch.manual_seed(0)
        model = make_model(8)
        train, _ = make_data(64)
        return Trainer(model, make_optimizer(model, cfg), train, config=cfg, loss_fn=loss, run_dir=run_dir,
                       unit="samples", **kwargs)

    try:
        failing = trainer(_FailingLoss())
        with pytest.raises(RuntimeError, match="boom at step 5"):
            failing.fit()
        failing.batches.close()
        wandb.teardown()  # wandb-core writes the file's last records when its service stops (a rank's exit)
        first = _read_run(run_dir)
        assert first["exit"] == [1] and sorted(first["history"]) == [2, 4]

        resumed = trainer(lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]), resume="auto")
        resumed.fit()
        resumed.close()
        wandb.teardown()
        both = _read_run(run_dir)
        assert len(both["files"]) == 2 and both["ids"] == [first["ids"][0]] * 2, both["ids"]
        assert both["exit"] == [1, 0] and sorted(both["history"]) == [2, 4, 6]  # steps 5-6 logged by the resume
        assert both["summary"]["final_step"] == 6
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert both["history"][6]["loss"] == records[-1]["loss"]
    finally:
        wandb.teardown()  # the wandb-core service of this pytest process ends with the test


def test_logger_wandb_without_wandb_is_one_line_and_exit_2_before_anything_starts(tmp_path, capsys, fake_gpus,
                                                                                   monkeypatch):
    fake_gpus(0)
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, as when not installed
    run_dir = tmp_path / "run"
    line = assert_bad_input(["train", "--logger", "wandb", "--run-dir", str(run_dir)],
                            'logger=wandb needs the wandb package', capsys, written=run_dir)
    assert 'pip install "multigpu[tracking]"' in line
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert_bad_input(["train", "logger=[jsonl, tensorboard]", "--run-dir", str(run_dir)],
                     'logger=tensorboard needs the tensorboard package', capsys, written=run_dir)
    assert_bad_input(["train", "--logger", "mlflow", "--run-dir", str(run_dir)],
                     "valid choices: 'jsonl', 'tensorboard', 'wandb'", capsys, written=run_dir)


def test_logger_values_parse_to_the_tracker_list():
    """``--logger a,b`` and YAML lists name the trackers; unset keeps TensorBoard-when-installed; [] is none."""
    from multigpu.config import apply_overrides, from_dict
    from multigpu.train import TrainConfig
    from multigpu.train.trackers import selected

    def parsed(*overrides):
        return from_dict(TrainConfig, apply_overrides({}, overrides)).logger

    assert parsed() is None
    assert parsed("logger=wandb") == ["wandb"]
    assert parsed("logger=tensorboard,wandb") == ["tensorboard", "wandb"]
    assert parsed("logger=[jsonl, wandb]") == ["jsonl", "wandb"] and selected(["jsonl", "wandb", "wandb"]) == ["wandb"]
    assert parsed("logger=[]") == []
    cfg = from_dict(TrainConfig, apply_overrides({}, ["wandb.project=p", "wandb.mode=offline", "wandb.tags=a,b"]))
    assert (cfg.wandb.project, cfg.wandb.mode, cfg.wandb.tags, cfg.wandb.name) == ("p", "offline", ["a", "b"], None)


class _Recorder:
    """A tracker that records what it was given."""

    def __init__(self):
        self.records, self.closed = [], []

    def log(self, record, unit):
        self.records.append((record["step"], unit))

    def close(self, summary=None, exit_code=0):
        self.closed.append((summary, exit_code))


def test_trackers_are_closed_once_with_the_runs_exit_code(monkeypatch):
    """An exception in the loop closes them with 1, Ctrl-C with 130 (W&B then marks the run failed, not running);
    a normal close passes the summary; a second close does nothing."""
    import multigpu as mg
    from multigpu.train.trackers import Trackers

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    mg.init()
    for error, code in ((RuntimeError("boom"), 1), (KeyboardInterrupt(), 130)):
        tracker = _Recorder()
        trackers = Trackers([tracker], "samples")
        with pytest.raises(type(error)), trackers.closed_on_error():
            raise error
        trackers.close({"final_step": 4})
        assert tracker.closed == [(None, code)]
    tracker = _Recorder()
    trackers = Trackers([tracker], "samples")
    with trackers.closed_on_error():
        trackers.log({"step": 1, "loss": 2.0, "grad_norm": 1.0, "lr": 0.1})
    trackers.close({"final_step": 1}, exit_code=143)
    assert tracker.records == [(1, "samples")] and tracker.closed == [({"final_step": 1}, 143)]
