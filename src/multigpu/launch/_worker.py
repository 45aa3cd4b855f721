"""The wrapper every worker runs first (inside each rank, before the user's script).

The launcher starts ``python -u <this file> [-m] target args...`` in each
worker. Run by path, it imports nothing of multigpu or torch before it has:

1. under ``--isolate-devices``, set ``CUDA_VISIBLE_DEVICES``,
   ``QD_VISIBLE_DEVICE``, ``TI_VISIBLE_DEVICE`` and ``EGL_DEVICE_ID`` to this
   worker's physical GPU, so simulators that read them at import see one GPU;
2. put the script's folder first on ``sys.path``, as ``python script.py`` does;
3. arrange that ``SIGUSR1`` and ``SIGTERM`` (what torch's agent sends to the
   surviving workers when one fails) first write every thread's Python stack
   to ``$MULTIGPU_STACKS_DIR/rank<R>.txt``, so the launcher can say where
   each rank stood;

then it runs the script as ``__main__`` under torch's ``record`` decorator, so
an exception lands in the worker's error file with its traceback, which the
launcher summarises.
"""

from __future__ import annotations

import os
import runpy
import sys

DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE", "EGL_DEVICE_ID")
"""Set together, per worker, under ``--isolate-devices``: CUDA, Quadrants/Taichi (Genesis), EGL renderers."""


def worker_device_env(env, local_rank: int) -> dict[str, str]:
    """The four device variables of one isolated worker; a rank beyond the GPU list sees no GPU."""
    ids = [i for i in env.get("MULTIGPU_DEVICE_MAP", "").split(",") if i]
    value = ids[local_rank] if local_rank < len(ids) else ""
    return {name: value for name in DEVICE_VARIABLES}


def _run(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


_STACK_FILE = None  # kept open for the life of the process: faulthandler writes to its descriptor


def _register_stack_dumps(folder: str | None, rank: str) -> None:
    import faulthandler
    import signal

    global _STACK_FILE
    if not folder or not hasattr(signal, "SIGUSR1"):
        return
    os.makedirs(folder, exist_ok=True)
    _STACK_FILE = open(os.path.join(folder, f"rank{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_STACK_FILE, all_threads=True)
    # chain=True: after the dump, SIGTERM does what it did before (end the process)
    faulthandler.register(signal.SIGTERM, file=_STACK_FILE, all_threads=True, chain=True)


def main(argv: list[str]) -> None:
    if os.environ.get("MULTIGPU_ISOLATE_DEVICES") == "1":
        os.environ.update(worker_device_env(os.environ, int(os.environ.get("LOCAL_RANK", "0"))))
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path[0] = os.getcwd()  # never let this folder shadow modules named config, agent, ...
    _register_stack_dumps(os.environ.get("MULTIGPU_STACKS_DIR"), os.environ.get("RANK", "0"))

    from torch.distributed.elastic.multiprocessing.errors import record

    record(_run)(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
