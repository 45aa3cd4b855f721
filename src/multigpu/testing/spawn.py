"""``run_on_ranks``: run a function on N real ranks (spawned, gloo, file store) and collect results.

Shipped so users test their own distributed code the way multigpu tests its own::

    def _check_sum(offset):              # module level, so it pickles
        t = torch.tensor([mg.rank() + offset])
        return mg.all_reduce(t).item()

    assert run_on_ranks(_check_sum, 3, args=(1,)) == [6, 6, 6]

Each rank is a fresh process, forked from a ``forkserver`` that has already
imported torch and multigpu (``spawn`` where there is no forkserver), so a rank
starts in a fraction of the ~2 s an ``import torch`` costs (its random generators are seeded afresh, as a new
process's are: :func:`multigpu.launch.forkserver.fresh_random_state`); it calls :func:`multigpu.init` (on the
CPU unless ``backend`` says otherwise) with a ``file://`` rendezvous in a temporary folder: no ports, safe under
parallel test runs. Three timeouts keep a test from hanging: the collective
timeout inside the ranks, a deadline in the parent (at which every unfinished
rank dumps its stacks, which the raised ``TimeoutError`` shows), and a
``faulthandler`` exit in each child in case the parent itself dies. The
parent's deadline counts from the moment every rank has started (joined the
group): how long a loaded machine takes to start processes is not part of it;
start-up has a deadline of its own.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from multigpu.errors import RankFailedError

if TYPE_CHECKING:
    from multigpu.runtime.context import RunContext

__all__ = ["run_on_ranks"]


def _child(fn, args, kwargs, rank, world_size, store_dir, results, timeout_s, collective_timeout_s, env, threads,
           backend, parent_env, stdio, group_of_one=False, startup_timeout_s=120.0):
    # A forked rank starts with the forkserver's environment and output: take the caller's, as a spawned
    # rank would (so output captured around the call, e.g. pytest's capfd, holds the ranks' prints too).
    for target, shared in zip((1, 2), stdio, strict=True):
        if shared is not None:
            fd = shared.detach()
            os.dup2(fd, target)
            os.close(fd)
    os.environ.clear()
    os.environ.update(parent_env)
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
            "OMP_NUM_THREADS": str(threads),
            **({"CUDA_VISIBLE_DEVICES": ""} if backend == "cpu" else {}),  # CPU ranks never touch a GPU
            **env,
        }
    )
    from multigpu.launch.forkserver import fresh_random_state

    fresh_random_state()  # a fork copied the forkserver's torch generator: each rank draws its own, as a new process
    stack_file = open(Path(store_dir) / f"stacks_rank{rank}.txt", "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    faulthandler.dump_traceback_later(startup_timeout_s + timeout_s + 60, exit=True, file=stack_file)  # parent gone
    try:
        import multigpu as mg

        if group_of_one:
            from multigpu.runtime import group

            group.enable_group_of_one()
        mg.init(backend=backend, timeout_s=collective_timeout_s, threads=threads,
                init_method=f"file://{store_dir}/store")  # its own rendezvous: no launcher variable is faked
        if world_size > 1:
            # every rank's group is whole before any fn runs: a rank whose fn returned at once used to destroy its
            # group while a peer was still in gloo's connectFullMesh ("Connection closed by peer", seen in a full
            # run). torch's own barrier: nothing the meters count
            import torch.distributed as dist

            dist.barrier()
        results.put(("ready", rank, None))  # the parent's deadline for fn starts when every rank has said this
        faulthandler.dump_traceback_later(timeout_s + 60, exit=True, file=stack_file)
        value = fn(*args, **kwargs)
        mg.shutdown(barrier=False)
        # plain pickle copies tensor data; the queue's own pickler would share memory that dies with this process
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("error", rank, traceback.format_exc()))


def _stop(procs: Sequence[mp.Process]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


_PRELOAD = ["torch", "torch.distributed", "multigpu", "multigpu.testing.spawn"]
"""What the forkserver imports once, so that no rank pays for it: nothing here touches a GPU or starts a thread."""


def _mp_context():
    """The forkserver context with torch preloaded (its server starts once per parent process), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    mp_ctx = mp.get_context("forkserver")
    mp_ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts; ignored after
    return mp_ctx


def _stdio() -> tuple:
    """The caller's stdout and stderr, as file descriptors a started process receives (None: closed)."""
    from multiprocessing import reduction

    shared = []
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            shared.append(None)
            continue
        shared.append(reduction.DupFd(fd))
    return tuple(shared)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 60.0,
    collective_timeout_s: float | None = None,
    env: dict[str, str] | None = None,
    threads: int = 1,
    backend: str = "cpu",
    ctx: RunContext | None = None,
    group_of_one: bool = False,
    startup_timeout_s: float = 120.0,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return each rank's result, in rank order.

    Args:
        fn: A module-level function (it is pickled into spawned processes).
            ``multigpu.init()`` has already run in each rank when it is called.
        world_size: Number of ranks.
        timeout_s: The parent's deadline for ``fn`` on all ranks together, in seconds, counted from the moment
            every rank has started (called ``multigpu.init`` and met the others): a slow start does not eat it.
        collective_timeout_s: Timeout of each collective inside the ranks
            (default: ``timeout_s``).
        env: Extra environment variables for every rank.
        threads: CPU threads per rank.
        backend: ``multigpu.init(backend=...)`` in each rank: "cpu" (default; the ranks see
            no GPU), or "auto"/"cuda" for GPU ranks, placed by ``env`` (e.g.
            ``{"CUDA_VISIBLE_DEVICES": "0,1"}``) and ``ctx``.
        ctx: The :class:`~multigpu.runtime.context.RunContext` the ranks read, as the launcher would
            give it (e.g. ``RunContext(isolated=True, pg_backend="gloo")`` for ranks sharing one GPU).
        group_of_one: With ``world_size=1``: create a real process group of one rank (NCCL with
            ``backend="cuda"``, else gloo), so collectives and point-to-point exchanges take their
            multi-rank paths (sends to itself go through a loopback on a thread). A one-GPU machine
            then runs the NCCL code paths. A switch of this harness only: nothing a user runs reads it.
        startup_timeout_s: The deadline for every rank to start (process, ``multigpu.init``, the first meeting).

    Raises:
        RankFailedError: the first rank that raised, with its traceback; the others are stopped.
        TimeoutError: ranks that did not start, or did not finish, in time, with every such rank's stack.
    """
    if group_of_one and world_size != 1:
        raise ValueError(f"group_of_one=True needs world_size=1, got {world_size}")
    mp_ctx = _mp_context()
    results = mp_ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="multigpu_ranks_") as store_dir:
        if ctx is not None:
            import json

            from multigpu.runtime.context import RUN_FILE_VAR

            run_file = Path(store_dir) / "run.json"
            run_file.write_text(json.dumps({"workload": None, "config": None, "run": ctx.to_dict()}))
            env = {**(env or {}), RUN_FILE_VAR: str(run_file)}
        procs = [
            mp_ctx.Process(
                target=_child,
                args=(fn, args, kwargs or {}, r, world_size, store_dir, results, timeout_s,
                      collective_timeout_s or timeout_s, env or {}, threads, backend, dict(os.environ), _stdio(),
                      group_of_one, startup_timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        values: dict[int, Any] = {}
        ready: set[int] = set()
        started = False  # every rank ready: the deadline below is fn's, no longer start-up's
        deadline = time.monotonic() + startup_timeout_s
        try:
            while len(values) < world_size:
                if not started and len(ready) == world_size:
                    started, deadline = True, time.monotonic() + timeout_s
                remaining = deadline - time.monotonic()
                if remaining <= 0 and started:
                    raise _timeout(procs, values, world_size, store_dir, f"did not finish within {timeout_s:g}s; a "
                                   "collective is probably waiting on a rank that never called it")
                if remaining <= 0:
                    raise _timeout(procs, ready, world_size, store_dir, f"did not start within {startup_timeout_s:g}s "
                                   "(the process, multigpu.init and a first meeting of the ranks)")
                try:
                    status, rank, value = results.get(timeout=min(remaining, 0.5))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in values and not p.is_alive() and p.exitcode]
                    if dead:
                        raise RankFailedError(dead[0], world_size, f"exited with code {procs[dead[0]].exitcode} before reporting") from None
                    continue
                if status == "error":
                    raise RankFailedError(rank, world_size, value)
                ready.add(rank)
                if status == "ok":
                    values[rank] = pickle.loads(value)
        finally:
            _stop(procs)
    return [values[r] for r in range(world_size)]


def _timeout(procs, done, world_size, store_dir, what: str) -> TimeoutError:
    stuck = [r for r in range(world_size) if r not in done]
    for r in stuck:
        if procs[r].is_alive() and procs[r].pid:
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    stacks = []
    for r in stuck:
        path = Path(store_dir) / f"stacks_rank{r}.txt"
        text = path.read_text() if path.exists() else ""
        stacks.append(f"--- rank {r} stack ---\n{text.strip() or '(no stack captured)'}")
    return TimeoutError(f"ranks {stuck} {what}\n" + "\n".join(stacks))
