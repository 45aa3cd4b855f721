"""What `multigpu verify` says after a FAIL: the script's lines that make a result depend on the world size."""

from __future__ import annotations

from multigpu.verify.causes import CHECKS, likely_causes
from tests.conftest import ROOT, SCRIPTS


def _seen(source: str) -> list[tuple[int, str]]:
    return [(c.line, c.why.split(":")[0]) for c in likely_causes(source)]


def test_nanogpts_per_rank_seed_and_divided_accumulation_are_named_by_line():
    source = (SCRIPTS / "nanogpt_train.py").read_text()
    seen = _seen(source)
    lines = source.splitlines()
    assert [lines[n - 1].strip() for n, _ in seen] == [
        "seed_offset = ddp_rank if seed_offset_by_rank else 0",
        "gradient_accumulation_steps //= ddp_world_size",
        "torch.manual_seed(1337 + seed_offset)",
    ]  # the docstring, which names the same things in prose, is not code
    assert [why for _, why in seen] == ["a seed that depends on the rank",
                                        "the accumulation steps divided by the world size",
                                        "a seed that depends on the rank"]


def test_a_divided_loss_a_mean_of_means_and_an_unsplit_loader_are_named():
    source = "\n".join([
        "loader = DataLoader(data, batch_size=8)",
        "loss = criterion(out, y) / dist.get_world_size()",
        "mean = mg.all_reduce(mine.mean(), 'mean')",
        "mg.init(seed=0, seed_per_rank=True)",
        "total = mg.all_reduce(mine.sum(), 'sum')  # fine",
    ])
    assert _seen(source) == [(1, "a DataLoader with no sampler that splits the data"),
                             (2, "the loss divided by the world size"),
                             (3, "a mean of the ranks' means"),
                             (4, "a seed that depends on the rank")]
    # a loader with a sampler, and the example that passes: nothing to name
    assert _seen("loader = DataLoader(data, sampler=DistributedSampler(data))") == []
    assert _seen((ROOT / "examples" / "verify_independent.py").read_text()) == []
    assert len(CHECKS) == 5 and all(CHECKS)
