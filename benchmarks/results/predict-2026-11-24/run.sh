#!/bin/bash
# Final bench --predict measurements: each bench alone (flock -x), 1-4 ranks, 1 thread each, 2 repeats.
cd /work/main
M=".venv/bin/python -m multigpu"
i=0
while IFS= read -r job; do
  i=$((i+1)); d=/tmp/final/b$i
  rm -rf $d
  flock -x /tmp/multigpu-bench.lock bash -c "echo \"== b$i: $job | start \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1 /proc/loadavg)\"; $M bench --weak --nproc 1,2,3,4 --threads 1 --repeat 2 --predict 3,4 -o $d $job > $d.log 2>&1; echo \"   rc \$? end \$(date -u +%H:%M:%S) load \$(cut -d' ' -f1 /proc/loadavg)\"; ps -eo pcpu,args --sort=-pcpu | head -3 | tail -2 | cut -c1-90"
done <<'JOBS'
train steps=10
train strategy=fsdp steps=10
sim steps=40
sim strategy=spatial steps=40
train steps=10 batch_size=8 block_size=256
train strategy=fsdp steps=10 model.kwargs.n_layer=6
sim steps=60 agents=500000
sim strategy=spatial steps=60 agents=4000000
infer
JOBS
