"""No process of a job outlives it, and signals end the launcher the same way at any moment (runs in the launcher).

torch's agent starts every worker in a session of its own (``start_new_session``),
signals the ones still running when the job ends, and waits for them. Three
things escape it:

* a signal that arrives while the agent is starting the workers interrupts its
  start-up loop, and the agent forgets the workers it had started so far: they
  ran on with parent 1;
* a process that a worker started (a fork, a subprocess, a daemon that called
  ``setsid``) is left when its worker has already exited, after a successful
  run too: the agent signals only workers still running;
* the launcher's own death (SIGKILL, the OOM killer): nothing in the launcher
  runs then, so the workers see to it themselves (``_worker.py``:
  ``PR_SET_PDEATHSIG``), and a tiny reaper process that outlives the launcher
  (``_reaper.py``) stops what they started: every process whose environment
  carries this job's ``MULTIGPU_JOB_TOKEN``.

:func:`job_processes` wraps one launch against all three. On Linux the
launcher is a *child subreaper* (``PR_SET_CHILD_SUBREAPER``) for the launch, so
a process whose worker exited is re-parented to the launcher, not to init, and
stays findable. At the end, every descendant that was not there before and
that lives in another session than the launcher's (only the agent's workers
and what they started do) gets SIGTERM, then SIGKILL after ``grace_s``, and is
reaped; its process group is signalled too, which takes a child forked in the
meantime.

It also raises torch's ``SignalException`` on SIGTERM, SIGHUP and SIGQUIT from
the start (torch registers its handlers only when it starts the workers, so a
SIGTERM during rendezvous used to end the launcher without a word), and puts
the previous handlers back afterwards (torch never does).

SIGUSR1 is a scheduler's warning (:data:`WARNING_SIGNAL`: the generated SLURM job file passes the batch script's
warning to every node's launcher with ``scancel --signal=USR1``; SLURM takes a SIGTERM sent that way for a
cancel, and a SIGTERM sent to ``srun`` makes it kill its step): the launcher takes it as SIGTERM, which it sends
itself, so the ranks finish their step, write its checkpoint and exit 143. :func:`warned` says it came.

Workers are born with SIGINT *blocked* (the signal mask survives ``exec``; torch's agent starts them with
:func:`_spawn_with_sigint_blocked` in place of its own function): Ctrl-C forwarded by the agent to a worker
whose interpreter is still starting stays pending instead of raising ``KeyboardInterrupt`` inside
``import site``, which is a fatal error of the interpreter ("Fatal Python error: init_import_site"). The
worker wrapper unblocks it first thing, inside its handler of ``KeyboardInterrupt`` (exit 130, no traceback).
A worker that still has it blocked when the agent stops the workers on Ctrl-C is sent SIGTERM as well, which ends
it at once (the agent otherwise waited its 30 s stop timeout for it, then SIGKILLed it).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
from torch.distributed.elastic.multiprocessing.api import SignalException

from multigpu import envvars

__all__ = ["HANDLED_SIGNALS", "job_processes", "leftover_processes", "stop_processes", "stop_workers"]

HANDLED_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT") if hasattr(signal, n))
"""The signals torch's agent turns into a ``SignalException`` (its ``signals_to_handle`` default)."""
WARNING_SIGNAL = getattr(signal, "SIGUSR1", None)
"""A scheduler's warning before it stops the job, which the launcher takes as SIGTERM (see the module's text)."""
_warned = threading.Event()

_PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
_PR_GET_CHILD_SUBREAPER = 37


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _set_subreaper(on: bool) -> bool | None:
    """Make this process a child subreaper (Linux); returns what it was before, None where unsupported."""
    prctl = _prctl()
    if prctl is None:
        return None
    import ctypes

    before = ctypes.c_int(0)
    if prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0) != 0:
        return None
    prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)
    return bool(before.value)


def _descendants() -> list[psutil.Process]:
    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def leftover_processes(before: set[int]) -> list[psutil.Process]:
    """Descendants not in ``before`` that live in another session than this process: what the workers left."""
    own_session = os.getsid(0)
    out = []
    for proc in _descendants():
        if proc.pid in before:
            continue
        try:
            if os.getsid(proc.pid) != own_session:
                out.append(proc)
        except OSError:
            continue  # gone already
    return out


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(procs: list[psutil.Process]) -> None:
    """Collect the exit status of those that are (now) this process's children, so no zombie stays."""
    for proc in procs:
        try:
            os.waitpid(proc.pid, os.WNOHANG)
        except (ChildProcessError, OSError):
            pass


def _signal_all(procs: list[psutil.Process], sig: int) -> None:
    groups = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            groups.add(os.getpgid(proc.pid))
            proc.send_signal(sig)  # psutil checks that the pid still names the same process
    own_group = os.getpgrp()
    for group in groups - {own_group}:
        with contextlib.suppress(OSError):
            os.killpg(group, sig)  # a group of a worker's session: only the job's processes are in it


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while True:
        _reap(procs)
        alive = [p for p in procs if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def stop_processes(procs: list[psutil.Process], grace_s: float) -> list[psutil.Process]:
    """SIGTERM, then SIGKILL after ``grace_s``; returns those still alive after that (none, normally)."""
    if not procs:
        return []
    _signal_all(procs, signal.SIGTERM)
    alive = _wait_gone(procs, grace_s)
    if alive:
        _signal_all(alive, signal.SIGKILL)
        alive = _wait_gone(alive, 10.0)
    return alive


_WORKERS: set[int] = set()
"""The pids of the workers torch's agent started in this launch (as new interpreters or from the fork server, whose
workers' command line is the launcher's own): :func:`stop_workers` stops these and nothing else."""


def stop_workers(grace_s: float = 3.0) -> None:
    """Stop this launcher's workers now (SIGTERM, then SIGKILL after ``grace_s``), not what else it started:
    torch's agent sees them end and goes on as after any failure (it ends the job, or restarts the group)."""
    mine = []
    for pid in sorted(_WORKERS):
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.ppid() == os.getpid() and proc.status() != psutil.STATUS_ZOMBIE:
                mine.append(proc)
    stop_processes(mine, grace_s)


def _start_reaper(token: str, remove_on_death: list[str]) -> tuple[subprocess.Popen, int] | None:
    """``_reaper.py`` in a session of its own, reading the launcher's end of a pipe; None where it cannot run.

    The write end stays in this process only (``os.pipe`` descriptors are not inherited), so it closes when this
    process dies, however it dies.
    """
    if not sys.platform.startswith("linux"):
        return None  # the reaper reads /proc
    read_end, write_end = os.pipe()
    try:
        reaper = subprocess.Popen([sys.executable, "-I", os.path.join(os.path.dirname(__file__), "_reaper.py"), token,
                                   *remove_on_death],
                                  stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    return reaper, write_end


def _stop_reaper(started: tuple[subprocess.Popen, int] | None) -> None:
    """The job ended with the launcher alive: the leftovers are stopped already; the reaper just exits."""
    if started is None:
        return
    from multigpu.launch._reaper import DONE

    reaper, write_end = started
    with contextlib.suppress(OSError):
        os.write(write_end, DONE)
    os.close(write_end)
    with contextlib.suppress(subprocess.TimeoutExpired):
        reaper.wait(timeout=5)


def _raise_signal(signum: int, frame) -> None:
    sig = signal.Signals(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def _warning(signum: int, frame) -> None:
    """The scheduler's warning: SIGTERM to this launcher, handled by whoever handles SIGTERM now."""
    _warned.set()
    os.kill(os.getpid(), signal.SIGTERM)


def warned() -> bool:
    """Whether the launch in progress (or the last one) got the scheduler's warning (:data:`WARNING_SIGNAL`)."""
    return _warned.is_set()


def _ignore(signum: int, frame) -> None:
    """A second signal while the leftovers are stopped: the job is ending anyway; let the stop finish."""


def _set_handlers(handlers: dict) -> dict:
    """Install ``{signal: handler}`` (main thread only); returns the handlers they replace."""
    previous = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for sig, handler in handlers.items():
        with contextlib.suppress(OSError, ValueError):
            previous[sig] = signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    return previous


def _still_starting(pid: int) -> bool:
    """Whether process ``pid`` is a worker not yet past its start-up (the wrapper unblocks SIGINT first thing):
    SIGINT blocked *and pending* (Linux: ``SigBlk`` and ``SigPnd``/``ShdPnd`` in ``/proc``). Blocked alone is no
    sign: the kernel also blocks it while the worker runs its SIGINT handler (then it is no longer pending). False
    where that cannot be read."""
    masks: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("SigBlk", "SigPnd", "ShdPnd"):
                    masks[key] = int(value.split()[0], 16)
    except (OSError, ValueError, IndexError):
        return False
    bit = 1 << (signal.SIGINT - 1)
    return bool(masks.get("SigBlk", 0) & bit) and bool((masks.get("SigPnd", 0) | masks.get("ShdPnd", 0)) & bit)


def _stop_a_starting_worker_too(handler) -> None:
    """Make torch's stop of this worker (``handler.close(SIGINT)`` on Ctrl-C) end it at once while it is starting.

    SIGINT stays pending in a worker whose interpreter is still starting (importing ``site``, a slow
    ``sitecustomize`` or ``.pth`` file, the wrapper's own imports): the agent waited its whole stop timeout (30 s)
    for it, then SIGKILLed it, so Ctrl-C took 30 s to return. Such a worker has run none of the script (nothing
    to save): it also gets SIGTERM, whose default action ends it without a word, as Python leaves SIGTERM alone
    during start-up. A worker past its start-up gets SIGINT alone, as before (:func:`_still_starting` tells them
    apart: a worker inside its SIGINT handler has it blocked too, and was SIGTERMed mid-checkpoint)."""
    close = getattr(handler, "close", None)
    proc = getattr(handler, "proc", None)
    if close is None or proc is None:
        return

    def close_starting_too(death_sig=None):
        close(death_sig=death_sig)
        if death_sig == signal.SIGINT and _still_starting(proc.pid):
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGTERM)  # its group, as torch's close signals (its own session)

    handler.close = close_starting_too


@contextlib.contextmanager
def _workers_born_with_sigint_blocked() -> Iterator[None]:
    """While the job runs, torch's agent starts every worker (restarts too) with SIGINT blocked."""
    from torch.distributed.elastic.multiprocessing import api

    original = api.get_subprocess_handler
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX: workers start as torch starts them
        yield
        return

    def _spawn_with_sigint_blocked(*args, **kwargs):
        before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # this thread only; the child inherits it
        try:
            handler = original(*args, **kwargs)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)  # a Ctrl-C meanwhile is delivered here, not lost
        _stop_a_starting_worker_too(handler)
        with contextlib.suppress(AttributeError):
            _WORKERS.add(handler.proc.pid)
        return handler

    api.get_subprocess_handler = _spawn_with_sigint_blocked
    try:
        yield
    finally:
        api.get_subprocess_handler = original
        _WORKERS.clear()


@contextlib.contextmanager
def job_processes(grace_s: float = 3.0, remove_on_death: list[str] | None = None) -> Iterator[list[int]]:
    """Wrap one launch; see the module docstring. Yields a list that ends holding the pids stopped at the end.

    ``remove_on_death``: folders the reaper removes after its sweep if the launcher dies (its private folders).

    Sets ``MULTIGPU_JOB_TOKEN`` in this process's environment for the launch (the workers inherit it).
    """
    TOKEN_VAR = envvars.JOB_TOKEN  # noqa: N806 - the reaper keeps its own copy (it imports nothing of ours)

    token = secrets.token_hex(16)
    saved_token = os.environ.get(TOKEN_VAR)
    os.environ[TOKEN_VAR] = token
    reaper = _start_reaper(token, list(remove_on_death or ()))
    before = {p.pid for p in _descendants()}  # the reaper included: it is not the workers' to stop
    stopped: list[int] = []
    was_subreaper = _set_subreaper(True)
    warning = (WARNING_SIGNAL,) if WARNING_SIGNAL is not None else ()
    saved = {sig: signal.getsignal(sig) for sig in (*HANDLED_SIGNALS, *warning)}  # torch restores none
    _warned.clear()
    # SIGINT stays Python's KeyboardInterrupt until torch takes it over
    _set_handlers({sig: _raise_signal for sig in HANDLED_SIGNALS if sig != signal.SIGINT})
    _set_handlers({sig: _warning for sig in warning})
    try:
        with _workers_born_with_sigint_blocked():
            yield stopped
    finally:
        _set_handlers({sig: _ignore for sig in (*HANDLED_SIGNALS, *warning)})
        try:
            leftovers = leftover_processes(before)
            stopped.extend(p.pid for p in leftovers)
            stop_processes(leftovers, grace_s)
        finally:
            _stop_reaper(reaper)
            _set_handlers(saved)
            if was_subreaper is False:
                _set_subreaper(False)
            if saved_token is None:
                os.environ.pop(TOKEN_VAR, None)
            else:
                os.environ[TOKEN_VAR] = saved_token
