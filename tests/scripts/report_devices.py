"""Write the four device variables this worker saw when its script started."""
import json
import os
import sys

seen = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE", "EGL_DEVICE_ID")}
seen["omp"] = os.environ.get("OMP_NUM_THREADS")
out = sys.argv[1]
with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as fh:
    json.dump(seen, fh)
