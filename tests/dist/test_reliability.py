"""The trainer on real gloo ranks when things go wrong: uneven per-rank data, a full disk while saving.

These pin two reliability contracts, in one spawn (a spawn costs seconds):

* ranks whose own data (``shard_data=False``) hold different numbers of
  batches end every epoch together, after the shortest rank's count. The step
  loop itself cannot hang on uneven data (each rank's stream runs over epochs
  until ``steps``), but without a common epoch length the ranks drift into
  different epochs, and a checkpoint (which records rank 0's position for all)
  would restart rank 1 at a position outside its own data. So the test also
  stops and resumes, and wants the uninterrupted run's parameters bit for bit.
* a checkpoint rank 0 cannot write (ENOSPC half-way through ``torch.save``)
  fails on *every* rank with the same one-line error, leaving the previous
  checkpoint intact and valid.
"""

from __future__ import annotations

import dataclasses
import errno
import os

import pytest
import torch

import multigpu as mg
from multigpu.checkpoint import files as checkpointing
from multigpu.checkpoint import CheckpointStore
from multigpu.errors import CheckpointWriteError
from multigpu.errors import ConfigError
from multigpu.testing import run_on_ranks
from multigpu.train import ModelConfig, TrainConfig, Trainer, make_optimizer
from multigpu.train.data import VOCAB, CharDataset
from multigpu.train.model import GPT

pytestmark = pytest.mark.dist

TINY = ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
BASE = TrainConfig(steps=9, batch_size=4, lr=3e-3, warmup_steps=1, eval_every=0, log_every=0, checkpoint_every=0,
                   prefetch=0)


def _own_data(num_samples: int, seed: int) -> CharDataset:
    """``num_samples`` samples of 8 characters, different on every rank."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, len(VOCAB), (num_samples * TINY.block_size + 1,), generator=gen, dtype=torch.uint8)
    return CharDataset(tokens, TINY.block_size)


def _trainer(cfg: TrainConfig, data, run_dir, **kwargs) -> tuple[Trainer, GPT]:
    torch.manual_seed(0)
    model = GPT(TINY, len(VOCAB))
    return Trainer(model, make_optimizer(model, cfg), data, config=cfg, run_dir=run_dir, **kwargs), model


def _params(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _uneven(tmp: str) -> dict[str, object]:
    out: dict[str, object] = {}
    # rank 0 holds 10 batches of 4, rank 1 holds 4: nine steps cross two epoch ends of rank 1
    mine = _own_data(40 if mg.rank() == 0 else 18, seed=mg.rank())
    trainer, model = _trainer(BASE, mine, f"{tmp}/uneven", shard_data=False)
    result = trainer.fit()
    trainer.close()
    whole = _params(model)
    out["steps"] = result["step"]
    out["in_step"] = bool(torch.equal(*mg.all_gather(whole.unsqueeze(0))))  # DDP kept replicas identical
    out["sampler"] = trainer.sampler_state  # after 9 steps of 4 batches per epoch: epoch 2, 1 batch in

    # stop after step 5 (in rank 1's second epoch), resume from its checkpoint: the same end, bit for bit
    first, _ = _trainer(dataclasses.replace(BASE, steps=5), mine, f"{tmp}/parts", shard_data=False)
    first.fit()
    first.close()
    second, model = _trainer(BASE, mine, f"{tmp}/parts", shard_data=False, resume="auto")
    second.fit()
    second.close()
    out["resumed_same"] = bool(torch.equal(_params(model), whole))

    # a rank whose own data hold no full batch: the same clear error on every rank, before any step
    tiny = _own_data(40 if mg.rank() == 0 else 3, seed=mg.rank())
    try:
        _trainer(BASE, tiny, None, shard_data=False)[0].setup()
        out["empty"] = None
    except ConfigError as exc:
        out["empty"] = str(exc)
    out["full_disk"] = _full_disk(tmp)
    return out


def _full_disk(tmp: str) -> dict[str, object]:
    """Rank 0's disk fills up half-way through the second checkpoint (ENOSPC raised inside torch.save)."""
    armed = {"on": False, "bytes": 0}
    real_write, real_save = checkpointing._CountingWriter.write, CheckpointStore.write

    def write(self, data):
        if armed["on"]:
            armed["bytes"] += len(data)
            if armed["bytes"] > 2000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(self, data)

    def save(self, *args, **kwargs):  # every write of a checkpoint (sync, or on the background writer)
        path = real_save(self, *args, **kwargs)
        armed["on"] = True  # the first checkpoint fits; the next one does not
        return path

    if mg.rank() == 0:
        checkpointing._CountingWriter.write, CheckpointStore.write = write, save
    cfg = dataclasses.replace(BASE, steps=4, checkpoint_every=2)
    trainer, _ = _trainer(cfg, _own_data(64, seed=0), f"{tmp}/full")
    try:
        trainer.fit()
        return {"error": None}
    except CheckpointWriteError as exc:
        return {"error": str(exc), "step": trainer.step}
    finally:
        checkpointing._CountingWriter.write, CheckpointStore.write = real_write, real_save


@pytest.mark.fault
def test_uneven_data_ends_epochs_together_and_a_full_disk_fails_every_rank_cleanly(tmp_path, capfd):
    results = run_on_ranks(_uneven, 2, args=(str(tmp_path),), timeout_s=120)
    for r in results:
        assert r["steps"] == 9 and r["in_step"] and r["resumed_same"], r
        assert r["sampler"]["epoch"] == 2 and r["sampler"]["offset"] == 4, r
        assert r["empty"] is not None and "full batches per rank: rank 0: 10, rank 1: 0" in r["empty"], r
    assert results[0]["sampler"] == results[1]["sampler"]
    out = capfd.readouterr().out
    assert "uneven data: full batches per epoch differ between ranks (rank 0: 10, rank 1: 4)" in out
    assert "every epoch runs 4 on each rank and skips the rest (6 batches in all)" in out

    folder = tmp_path / "full" / "checkpoints"
    for r in (r["full_disk"] for r in results):
        assert r["step"] == 4, r
        assert r["error"] == (f"could not write checkpoint {folder}/step_00000004: No space left on device "
                              "(ENOSPC); the previous checkpoint step_00000002 is intact"), r
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002"]  # no half folder, no .tmp
    assert CheckpointStore(folder).latest() == folder / "step_00000002"
    assert torch.load(folder / "step_00000002" / "state.pt", weights_only=True)["trainer"]["step"] == 2
