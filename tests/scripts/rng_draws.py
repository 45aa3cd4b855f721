"""What each random generator a worker can touch draws first, as JSON in <folder>/rank<R>.json:
``python rng_draws.py FOLDER [SEED]``. With SEED, the script calls ``mg.init(seed=SEED)`` first (the documented way to
make the ranks' draws reproducible); without it, it touches no generator before drawing (as a user's script that
never seeds). The worker-RNG test runs it under torchrun and under ``multigpu launch`` and compares."""
import json
import os
import random
import sys

import numpy
import torch

folder = sys.argv[1]
if len(sys.argv) > 2:
    import multigpu as mg

    mg.init(seed=int(sys.argv[2]))
rank = os.environ["RANK"]
# a device seed set before this process was this rank, waiting for the device's start (torch queues them)
trackers = {name: getattr(getattr(torch, name, None), "_lazy_seed_tracker", None) for name in ("cuda", "xpu", "mtia")}
queued = [name for name, tracker in trackers.items() if tracker is not None and any(tracker.get_calls())]
draws = {
    "torch_initial_seed": torch.initial_seed(),
    "torch": torch.randint(0, 10**9, (3,)).tolist(),
    "random": random.random(),
    "numpy_legacy": float(numpy.random.rand()),
    "numpy_default_rng": float(numpy.random.default_rng().random()),
    "hash": hash("the string hash seed"),
    "queued_device_seeds": queued,
}
with open(os.path.join(folder, f"rank{rank}.json"), "w") as fh:
    json.dump(draws, fh)
