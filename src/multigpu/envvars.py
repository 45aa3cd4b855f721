"""Every ``MULTIGPU_*`` environment variable, defined and documented here once (both sides).

A variable crosses from the launcher to the ranks only where it must exist
before Python starts or before the run file is read; everything else about a
run travels in ``run.json`` (:mod:`multigpu.runtime.context`). Code names these
constants instead of spelling the strings (the worker wrapper,
:mod:`multigpu.launch._worker`, runs before anything of multigpu may be
imported, so it keeps copies of the six it reads; a test holds them equal).

==========================  ==========================  ===================================================
variable                    set by                      read by, and what it means
==========================  ==========================  ===================================================
``MULTIGPU_RUN_FILE``       the launcher, per job       every rank (:mod:`multigpu.runtime.context`): the
                                                        path of ``run.json`` (workload, resolved config,
                                                        run context); its presence also marks a real launch
``MULTIGPU_DEVICE_MAP``     the launcher, under         the worker wrapper: the physical GPU of each local
                            ``--isolate-devices``       rank, comma-separated; it sets
                                                        ``CUDA_VISIBLE_DEVICES``, ``QD_VISIBLE_DEVICE``,
                                                        ``TI_VISIBLE_DEVICE`` and ``EGL_DEVICE_ID`` from it
                                                        before anything is imported
``MULTIGPU_GPU_RANKS``      the launcher, in a hybrid   the worker wrapper: local ranks from this one on
                            job (``--allow-cpu-ranks``) are CPU ranks; it sets their
                                                        ``CUDA_VISIBLE_DEVICES`` (and the other device
                                                        variables) empty before anything is imported
``MULTIGPU_STACKS_DIR``     the launcher (its log       the worker wrapper, the stall watchdog and train's
                            folder's ``stacks/``)       interrupt handler: where a rank writes its Python
                                                        stacks on SIGTERM/SIGUSR1 or a stall
``MULTIGPU_LAUNCHER_PID``   the launcher                the worker wrapper: the parent it must have; it
                                                        arms ``PR_SET_PDEATHSIG`` and exits at once if its
                                                        parent is already another process
``MULTIGPU_DEBUG``          ``multigpu --debug``, or    the launcher and the workers: ``1`` shows Python
                            the user                    tracebacks instead of one line per error
``MULTIGPU_NATIVE``         the user                    the simulation (:mod:`multigpu.sim.native`): ``0``
                                                        skips the compiled C kernels and runs the torch
                                                        code (default ``1``: compile them where a C
                                                        compiler is found)
==========================  ==========================  ===================================================

The test suite has its own, read by nothing in the package:
``MULTIGPU_TEST_SESSION`` and ``MULTIGPU_TEST_SHARED`` (tests/conftest.py: which
processes a test session started), ``MULTIGPU_TEST_SEEN``
(tests/dist/test_collectives.py) and ``MULTIGPU_SOAK_ITERS`` (the length of
tests/dist/test_soak.py). Besides these, the launcher sets torchrun's own
variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...),
``OMP_NUM_THREADS`` (the thread budget), ``GLOO_SOCKET_IFNAME`` (loopback on
one node) and ``CUDA_VISIBLE_DEVICES`` (the selected GPUs).
"""

from __future__ import annotations

__all__ = ["DEBUG", "DEVICE_MAP", "GPU_RANKS", "LAUNCHER_PID", "NATIVE", "RUN_FILE", "STACKS_DIR"]

RUN_FILE = "MULTIGPU_RUN_FILE"
DEVICE_MAP = "MULTIGPU_DEVICE_MAP"
GPU_RANKS = "MULTIGPU_GPU_RANKS"
STACKS_DIR = "MULTIGPU_STACKS_DIR"
LAUNCHER_PID = "MULTIGPU_LAUNCHER_PID"
DEBUG = "MULTIGPU_DEBUG"
NATIVE = "MULTIGPU_NATIVE"
