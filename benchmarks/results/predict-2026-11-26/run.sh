#!/bin/bash
# bench --predict on hsdp jobs (2026-11-26): each bench alone (flock -x), one thread per rank, 2 repeats.
# hsdp-2x2: hsdp_shard_size=2 fitted on 2 ranks (1 replica x 2), compared with 4 ranks (2 replicas x 2);
# hsdp-node: the default shard group (the ranks of this one host: every rank), fitted on 1-2, compared with 3 and 4.
cd "$(dirname "$0")/../../.."
M=".venv/bin/python -m multigpu"
flock -x /tmp/multigpu-bench.lock $M bench --weak --nproc 2,4 --threads 1 --repeat 2 --predict 4 -o /tmp/hs/h1 \
  train strategy=hsdp hsdp_shard_size=2 steps=10
flock -x /tmp/multigpu-bench.lock $M bench --weak --nproc 1,2,3,4 --threads 1 --repeat 2 --predict 3,4 -o /tmp/hs/h2 \
  train strategy=hsdp steps=10
# fsdp after the untimed-collectives change (predict.UNTIMED_KINDS), fresh runs: f1-f3
for job in "train strategy=fsdp steps=10" "train strategy=fsdp steps=10 model.kwargs.n_layer=6" \
           "train strategy=fsdp steps=10 batch_size=8 block_size=256"; do
  flock -x /tmp/multigpu-bench.lock $M bench --weak --nproc 1,2,3,4 --threads 1 --repeat 2 --predict 3,4 -o /tmp/hs/f $job
done
