"""Every ``MULTIGPU_*`` environment variable, defined and documented here once (both sides).

A variable crosses from the launcher to the ranks only where it must exist
before Python starts or before the run file is read; everything else about a
run travels in ``run.json`` (:mod:`multigpu.runtime.context`). Code names these
constants instead of spelling the strings (the worker wrapper,
:mod:`multigpu.launch._worker`, runs before anything of multigpu may be
imported, so it keeps copies of the five it reads, and the reaper, which imports nothing of multigpu,
of ``MULTIGPU_JOB_TOKEN``; a test holds them equal).

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
``MULTIGPU_STACKS_DIR``     the launcher (its log       the worker wrapper, the stall watchdog and train's
                            folder's ``stacks/``)       interrupt handler: where a rank writes its Python
                                                        stacks on SIGTERM/SIGUSR1 or a stall
``MULTIGPU_LAUNCHER_PID``   the launcher                the worker wrapper: the parent it must have; it
                                                        arms ``PR_SET_PDEATHSIG`` and exits at once if its
                                                        parent is already another process
``MULTIGPU_DEBUG``          ``multigpu --debug``, or    the launcher and the workers: ``1`` shows Python
                            the user                    tracebacks instead of one line per error
``MULTIGPU_JOB_TOKEN``      the launcher, per job       inherited by the workers and everything they start:
                                                        the job's reaper (:mod:`multigpu.launch._reaper`)
                                                        stops every process of the user that carries it
                                                        when the launcher dies (SIGKILL, the OOM killer)
``MULTIGPU_RDZV_SECRET``    the user, on every node of  the launcher: signs (HMAC-SHA256) the rendezvous
                            a multi-node job            state and refuses any other; never passed to the
                                                        workers (one node: a random secret in memory)
``MULTIGPU_NATIVE``         the user                    the simulation (:mod:`multigpu.sim.native`): ``0``
                                                        skips the compiled C kernels and runs the torch
                                                        code (default ``1``: compile them where a C
                                                        compiler is found)
==========================  ==========================  ===================================================

The test suite has a few of its own (which processes a test session started, the
length of the soak test: see tests/conftest.py), read by nothing in the package.
Besides these, the launcher sets torchrun's own
variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...),
``OMP_NUM_THREADS`` (the thread budget), ``GLOO_SOCKET_IFNAME`` (loopback on
one node), ``CUDA_VISIBLE_DEVICES`` (the selected GPUs) and, for CPU ranks,
glibc's ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_``
(:mod:`multigpu.launch.heap`).
"""

from __future__ import annotations

__all__ = ["DEBUG", "DEVICE_MAP", "JOB_TOKEN", "LAUNCHER_PID", "NATIVE", "RDZV_SECRET", "RUN_FILE", "STACKS_DIR"]

RUN_FILE = "MULTIGPU_RUN_FILE"
DEVICE_MAP = "MULTIGPU_DEVICE_MAP"
JOB_TOKEN = "MULTIGPU_JOB_TOKEN"
RDZV_SECRET = "MULTIGPU_RDZV_SECRET"
STACKS_DIR = "MULTIGPU_STACKS_DIR"
LAUNCHER_PID = "MULTIGPU_LAUNCHER_PID"
DEBUG = "MULTIGPU_DEBUG"
NATIVE = "MULTIGPU_NATIVE"
