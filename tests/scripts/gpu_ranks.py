"""Each rank writes where it runs and what a collective on its device gave: OUT/rank<R>.json.

    multigpu launch --gpus all tests/scripts/gpu_ranks.py OUT [--force-nccl]

``--force-nccl`` asks for NCCL whatever the launcher chose (to meet NCCL's
refusal of two ranks on one GPU).
"""
import json
import os
import sys

import torch

import multigpu as mg

out = sys.argv[1]
if "--force-nccl" in sys.argv:  # override the launcher's choice in this rank's run context
    import dataclasses

    from multigpu.runtime import context

    context.set_current(dataclasses.replace(context.current(), pg_backend="nccl"))
env = mg.init()
t = torch.ones(4, device=env.device) * (env.rank + 1)
mg.all_reduce(t)
gathered = mg.gather(torch.full((env.rank + 1,), float(env.rank), device=env.device), dst=0)
props = torch.cuda.get_device_properties(env.device) if env.device.type == "cuda" else None
seen = {
    "rank": env.rank, "world_size": env.world_size, "device": str(env.device), "backend": env.backend,
    "cuda_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    "uuid": str(props.uuid) if props is not None else None,
    "sum": t.tolist(), "gathered": gathered.tolist() if gathered is not None else None,
    **{k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE", "EGL_DEVICE_ID")},
}
with open(os.path.join(out, f"rank{env.rank}.json"), "w") as fh:
    json.dump(seen, fh)
mg.shutdown()
