"""A result that does not depend on the world size: `multigpu verify` passes (runs inside each rank).

    multigpu verify --nproc 1,2,3 examples/verify_independent.py

Every item's value is computed from the item's own id (not from the rank), the
shards are gathered back in the original order, and the total is summed on
rank 0 in that order: 1, 2 or 3 ranks give bit-identical results.
"""

import torch

import multigpu as mg


def main() -> None:
    mg.init(seed=0)
    n_items = 10
    mine = mg.shard_range(n_items)
    lo, hi = mine.start, mine.stop
    ids = torch.arange(lo, hi, dtype=torch.float64)
    values = torch.sin(ids * 0.7) * ids**2  # a pure function of the item id
    mg.verify.record("values", values, gather=True)  # gathers the shards on rank 0, in the original order
    everything = mg.gather(values)  # rank 0: all items, original order; others: None
    count = mg.all_reduce(torch.tensor([hi - lo]), "sum")  # integers: exact in any order
    mg.verify.record("total", everything.sum() if mg.is_main() else None)
    mg.verify.record("count", count)
    if mg.is_main():
        print(f"verify_independent: {mg.world_size()} rank(s), total {everything.sum().item():.6f}", flush=True)
    mg.shutdown()


if __name__ == "__main__":
    main()
