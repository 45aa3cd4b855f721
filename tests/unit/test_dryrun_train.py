"""The dry run's training step on fake tensors measures what the same step on real CPU tensors allocates."""

import pytest

from multigpu.config import from_dict
from multigpu.jobs.dryrun import fake_world
from multigpu.train.dryrun import _collate, _fake_steps
from multigpu.train.job import TrainJobConfig


class _Tokens:
    """A tiny next-token data set: (x, y) pairs of ``block`` tokens."""

    vocab_size = 50

    def __init__(self, n: int, block: int):
        import torch

        self.data = torch.randint(0, self.vocab_size, (n * block + 1,), generator=torch.Generator().manual_seed(0))
        self.n, self.block = n, block

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        chunk = self.data[i * self.block: (i + 1) * self.block + 1]
        return chunk[:-1], chunk[1:]


def test_fake_step_figures_match_a_real_cpu_step():
    cfg = from_dict(TrainJobConfig, {"model": {"factory": "multigpu.train.nano:gpt",
                                               "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 64}}, "block_size": 32})
    data = _Tokens(64, 32)
    assert _collate(data, 4)[0].shape == (4, 32)
    with fake_world(0, 1):
        fake, fake_peak = _fake_steps(cfg, data, 1, 8)
        real, real_peak = _fake_steps(cfg, data, 1, 8, fake=False)
    assert [f.name for f in fake] == [f.name for f in real]
    for f, r in zip(fake, real, strict=True):
        assert f.bytes == pytest.approx(r.bytes, rel=0.01), f.name
        assert f.bytes > 0 or f.name == "buffers", f.name
    assert fake_peak.bytes == pytest.approx(real_peak.bytes, rel=0.01)


def test_hsdp_holds_one_shard_of_a_replica_and_the_dry_run_says_how_many(capsys):
    """Under hsdp a rank's parameters are 1/hsdp_shard_size of the model (a 2-D mesh of fake ranks), not
    1/world_size as under fsdp; the command line's default shard group is the ranks per node."""
    from multigpu.cli import main as cli_main

    model = {"factory": "multigpu.train.nano:gpt", "kwargs": {"n_layer": 2, "n_head": 2, "n_embd": 64}}
    data = _Tokens(64, 32)
    params = {}
    for strategy, world, shards in (("ddp", 1, None), ("fsdp", 8, None), ("hsdp", 8, 2)):
        cfg = from_dict(TrainJobConfig, {"model": model, "block_size": 32, "strategy": strategy})
        with fake_world(0, world):
            figures, _ = _fake_steps(cfg, data, world, 4, shard_size=shards)
        params[strategy] = next(f.bytes for f in figures if f.name == "parameters")
    assert params["hsdp"] == pytest.approx(params["ddp"] / 2, rel=0.05)
    assert params["fsdp"] == pytest.approx(params["ddp"] / 8, rel=0.05)

    code = cli_main(["train", "--strategy", "hsdp", "--dry-run", "--world-size", "8", "--nproc-per-node", "2", "--cpu",
                     "model.kwargs.n_layer=1", "model.kwargs.n_embd=32", "model.kwargs.n_head=2", "block_size=16",
                     "data.kwargs.max_chars=20000", "batch_size=2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "hsdp: 4 replica(s) × 2 ranks (each rank holds 1/2 of the training state)" in out
    assert "parameters" in out and "this rank's shard" in out
