"""Checkpoints written in the background (``checkpoint_mode=async``) on real gloo ranks, in one spawn.

These pin the contracts of the background writer:

* the run goes on while a checkpoint is written: steps run (and issue their collectives on the default group)
  while the writer's own collectives (DCP's plan exchange, the checksums gathered to rank 0) run on the
  writer's gloo group; a save due while the previous write is in flight waits for it, and says so once;
* what it writes is what a synchronous save writes: the same step folders, the same values (and types, and a
  state dict's version table) in ``state.pt``, the same bytes in every rank's DCP shards; a resume from it
  continues the same run;
* a write that fails (ENOSPC in one rank's shard) raises on every rank, at the same step (the next save), the
  one line a synchronous save raises, and leaves the previous checkpoint intact and no temporary folder.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import time
from pathlib import Path

import pytest
import torch

import multigpu as mg
from multigpu.checkpoint import CheckpointStore, CheckpointWriteError, PerRank, RngState, Sharded
from multigpu.run import Run, script_context
from multigpu.testing import run_on_ranks

pytestmark = pytest.mark.dist

STEPS, EVERY = 6, 2


class _Shards:
    """A sharded part: a (8, 3) tensor, rows split over the ranks (a DTensor)."""

    def __init__(self):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (mg.world_size(),))
        self.t = distribute_tensor(torch.arange(24, dtype=torch.float32).reshape(8, 3), mesh, [Shard(0)])

    def state_dict(self):
        return {"t": self.t}

    def load_state_dict(self, state):
        self.t = state["t"]


class _Progress:
    def __init__(self):
        self.losses: list[float] = []

    def state_dict(self):
        return {"losses": list(self.losses)}

    def load_state_dict(self, state):
        self.losses = list(state["losses"])


def _parts():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return model, opt, _Shards(), _Progress()


def _train(run_dir: str, mode: str, slow_s: float = 0.0, resume: str | None = None):
    """STEPS steps of a tiny model on every rank, a checkpoint every EVERY; returns the run and what it saw."""
    model, opt, shards, progress = _parts()
    state = {"model": model, "optim": opt, "shards": Sharded(shards), "rng": PerRank(RngState()),
             "progress": progress}
    run = Run(script_context(run_dir, resume), state, total=STEPS, checkpoint_every=EVERY, mode=mode)
    if run.resume_from is not None:
        run.load()
    real = os.fsync
    if slow_s:  # a slow disk under checkpoints/: each write takes a while, the steps go on meanwhile
        def fsync(fd):
            if "/checkpoints/" in os.readlink(f"/proc/self/fd/{fd}"):
                time.sleep(slow_s)
            return real(fd)

        os.fsync = fsync
    writing = []
    try:
        for step in run.steps():
            gen = torch.Generator().manual_seed(step * 10 + mg.rank())
            loss = model(torch.randn(5, 4, generator=gen)).square().mean()
            loss.backward()
            for p in model.parameters():  # the gradient averaged over ranks: a collective on the default group
                mg.all_reduce(p.grad, "mean")
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                shards.t += 1.0
            progress.losses.append(round(float(mg.all_reduce(loss.detach().clone(), "mean")), 6))  # every rank's
            writing.append(run.checkpoints.writing)
    finally:
        os.fsync = real
    run.close()
    return run, (model, shards, progress), writing


def _shards(folder: Path) -> dict[str, str]:
    """The SHA-256 of every DCP shard (``state.pt`` differs in every save: torch.save writes a random id)."""
    files = json.loads((folder / "manifest.json").read_text())["files"]
    return {name: entry["sha256"] for name, entry in files.items() if name.endswith(".distcp")}


def _same(a, b) -> bool:
    """Equal values, types and structure, a state dict's version table (``_metadata``) included."""
    if type(a) is not type(b) or getattr(a, "__dict__", None) != getattr(b, "__dict__", None):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _same_checkpoint(a: Path, b: Path) -> bool:
    load = lambda folder: torch.load(folder / "state.pt", weights_only=True)  # noqa: E731
    return _shards(a) == _shards(b) and len(_shards(a)) == mg.world_size() and _same(load(a), load(b))


def _async_like_sync(tmp: str) -> dict:
    out: dict = {}
    sync_run, _, _ = _train(f"{tmp}/sync", "sync")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        async_run, (model, shards, progress), writing = _train(f"{tmp}/async", "async", slow_s=0.3)
    out["printed"] = printed.getvalue()
    out["writing"] = writing
    out["stall_s"], out["write_s"] = async_run.checkpoints.stall_s, async_run.checkpoints.write_s
    sync_dir, async_dir = Path(tmp, "sync", "checkpoints"), Path(tmp, "async", "checkpoints")
    out["folders"] = [sorted(p.name for p in d.iterdir()) for d in (sync_dir, async_dir)]
    out["same"] = all(_same_checkpoint(sync_dir / name, async_dir / name) for name in out["folders"][0])
    # resumed from the async run's step 4 (the newest kept is 6: resume from the path given)
    again, (model2, shards2, progress2), _ = _train(f"{tmp}/again", "async", resume=str(async_dir / "step_00000004"))
    out["resumed_at"] = again.start
    whole, whole2 = shards.t.full_tensor(), shards2.t.full_tensor()  # collectives: on every rank
    out["resumed_same"] = {"model": torch.equal(model2.weight, model.weight), "progress": progress2.losses == progress.losses,
                           "shards": torch.equal(whole2, whole)}
    out["failure"] = _full_disk(tmp)
    return out


def _full_disk(tmp: str) -> dict:
    """Rank 1's shard of the second checkpoint does not reach the disk (ENOSPC at its fsync, where a full disk
    often shows): every rank raises at the next save."""
    real = os.fsync
    armed = {"on": False}

    def fsync(fd):
        if armed["on"] and os.readlink(f"/proc/self/fd/{fd}").endswith("step_00000004.tmp/__1_0.distcp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)

    model, opt, shards, progress = _parts()
    run = Run(script_context(f"{tmp}/full"), {"model": model, "shards": Sharded(shards)}, total=8,
              checkpoint_every=2, mode="async")
    os.fsync = fsync
    try:
        for _ in run.steps():
            armed["on"] = mg.rank() == 1
            mg.all_reduce(torch.ones(1))
        return {"error": None}
    except CheckpointWriteError as exc:
        return {"error": str(exc), "step": run.step}
    finally:
        os.fsync = real


def test_a_background_write_is_the_synchronous_one_off_the_critical_path(tmp_path):
    results = run_on_ranks(_async_like_sync, 2, args=(str(tmp_path),), timeout_s=180)
    steps = [f"step_{s:08d}" for s in range(EVERY, STEPS + 1, EVERY)]
    for r in results:
        assert r["folders"] == [steps, steps], r["folders"]
        assert r["same"], "an async checkpoint holds other values than the sync one"
        assert r["resumed_at"] == 4 and all(r["resumed_same"].values()), r["resumed_same"]
        # steps ran while a checkpoint was being written (0.3 s per fsync); the first save (nothing to wait for)
        # held the run for a fraction of its write, the later ones waited for the write before them
        assert any(w is not None for w in r["writing"]), r["writing"]
        assert r["stall_s"][0] < min(r["write_s"]) / 10, (r["stall_s"], r["write_s"])
    printed = results[0]["printed"]
    assert printed.count("is still being written when step") == 1, printed  # said once, on rank 0
    assert "checkpoint: step_00000002 is still being written when step 4 is due; the run waits for it" in printed
    assert results[1]["printed"] == ""

    folder = tmp_path / "full" / "checkpoints"
    for r in (r["failure"] for r in results):
        assert r["step"] == 6, r  # raised at the next save, on every rank
        assert r["error"] == (f"could not write checkpoint {folder}/step_00000004: rank 1: No space left on device "
                              "(ENOSPC); the previous checkpoint step_00000002 is intact"), r
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002"]  # no half folder, no .tmp
    assert CheckpointStore(folder).latest() == folder / "step_00000002"
