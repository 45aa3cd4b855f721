"""A classic split-dependent bug: `multigpu verify` catches it (runs inside each rank).

    multigpu verify --nproc 1,2,3 examples/verify_dependent.py     # fails on 'mean' at 3 ranks

The mean of the per-rank means equals the global mean only when every rank
holds the same number of items: 10 items on 2 ranks (5 + 5) agree, on 3 ranks
(4 + 3 + 3) they do not. 'total' is computed correctly and passes.
"""

import torch

import multigpu as mg


def main() -> None:
    mg.init(seed=0)
    part = mg.shard_range(10)
    lo, hi = part.start, part.stop
    mine = torch.arange(lo, hi, dtype=torch.float64) ** 2
    total = mg.all_reduce(mine.sum(), "sum")  # right: sum of sums (integers in float64: exact)
    mean = mg.all_reduce(mine.mean(), "mean")  # wrong: mean of means weighs small shards more
    mg.verify.record("total", total)
    mg.verify.record("mean", mean)
    if mg.is_main():
        print(f"verify_dependent: {mg.world_size()} rank(s), mean {mean.item():.4f} (true mean 28.5)", flush=True)
    mg.shutdown()


if __name__ == "__main__":
    main()
