"""What a worker sees of its own process, as JSON in <folder>/rank<R>.json (the fork server's test):
``python forked_worker.py FOLDER ARGS...``. Also prints a line, writes <folder>/atexit<R> at the
interpreter's exit, and leaves <folder>/open<R> written but never closed, held by a module it imported.
``inheritable_fds``: what its descriptors above 2 that a child it starts would inherit lead to."""
import atexit
import json
import os
import sys
import types

import numpy
import torch

folder = sys.argv[1]
rank = os.environ["RANK"]


def _cmdline(pid) -> list[str]:
    with open(f"/proc/{pid}/cmdline", "rb") as fh:
        return fh.read().decode().split("\0")[:-1]


def _refaults(mib: int = 48) -> int:
    """The fewest minor page faults to fill a ``mib`` MiB tensor in 12 tries, each freed before the next: ~0 once
    the heap holds a free block that fits (the launcher's policy for CPU ranks; glibc's alignment for torch leaves
    the first few freed blocks a few bytes short), ``mib`` * 256 every time when glibc unmaps and maps it again."""
    import resource

    faults = []
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(mib << 18)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return min(faults)


facts = {
    "pid": os.getpid(), "own_session": os.getsid(0) == os.getpid(), "cmdline": _cmdline("self"),
    "parent_cmdline": _cmdline(os.getppid()), "threads": torch.get_num_threads(),
    "omp": os.environ.get("OMP_NUM_THREADS"), "refaults": _refaults(), "draw": float(numpy.random.rand()), "path0": sys.path[0],
    "argv": sys.argv, "cwd": os.getcwd(), "stdin_fd_open": os.path.exists("/proc/self/fd/0"),
    "inheritable_fds": sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in map(int, os.listdir("/proc/self/fd"))
                              if fd > 2 and os.path.exists(f"/proc/self/fd/{fd}") and os.get_inheritable(fd)),
}
with open(os.path.join(folder, f"rank{rank}.json"), "w") as fh:
    json.dump(facts, fh)
atexit.register(lambda: open(os.path.join(folder, f"atexit{rank}"), "w").close())
held = types.ModuleType("held_open")  # a module of the script's, holding a file it never closes
sys.modules["held_open"] = held
held.file = open(os.path.join(folder, f"open{rank}"), "w")  # noqa: SIM115
held.file.write("flushed at exit")
print(f"hello from rank {rank}", flush=True)
