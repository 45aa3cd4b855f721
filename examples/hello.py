"""Shard a list of work over the ranks, compute, gather on rank 0 (runs inside each rank).

    multigpu launch --nproc-per-node 2 examples/hello.py
"""

import torch

import multigpu as mg


def main() -> None:
    env = mg.init(seed=0)
    items = list(range(1, 11))
    mine = mg.shard(items)  # contiguous, every item exactly once
    squares = [x * x for x in mine]
    print(f"rank {env.rank}/{env.world_size} on {env.device}: items {list(mine)} -> {squares}", flush=True)
    gathered = mg.gather(squares)  # original order, on rank 0
    total = mg.all_reduce(torch.tensor([sum(squares)]), "sum").item()
    if mg.is_main():
        print(f"gathered on rank 0: {gathered} (sum {total})", flush=True)
    mg.shutdown()


if __name__ == "__main__":
    main()
