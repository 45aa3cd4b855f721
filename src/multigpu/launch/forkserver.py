"""Workers forked with torch already imported, from a copy of the launcher made before it did anything (Linux).

Runs in the launcher, and (its second half) in each worker before the worker wrapper. A worker started as
``python -u _worker.py script.py`` spends most of its start importing torch, which the launcher had done
already: each rank paid it again (1-2 s of CPU each), after the launcher's own. So a command started for
itself (the ``multigpu`` console script, ``python -m multigpu``: :func:`multigpu.cli.main` with no argument
list) calls :func:`start` first thing. It forks a *fork server*: a copy of the launcher taken right after its
imports, before it has parsed an argument, probed a device (CUDA, which a fork must never inherit),
started a thread of its own or set a signal handler. While a job runs (:func:`serving`), torch's agent, which
would ``Popen`` the worker wrapper, asks the fork server for the worker instead:

1. the server forks, and that child forks the worker and exits, so the worker is re-parented to the launcher
   (a child subreaper while a job runs, :mod:`multigpu.launch.processes`): the launcher waits for it, signals
   it and reads its exit status as it would a ``Popen``'s (:class:`ForkedProcess`);
2. the worker makes a session of its own (as ``Popen(start_new_session=True)`` does: torch's agent signals
   its group), takes the launcher's standard streams as they are now (or torch's log files), closes the other
   descriptors a ``Popen`` would not pass on, takes the launcher's umask as it is now (the command's private
   0077), its working folder and its environment (replacing the server's), sets the thread counts that the environment asks for
   (OpenMP's and OpenBLAS's were read when torch loaded) and glibc's heap thresholds (:mod:`multigpu.launch.heap`,
   read when the launcher started), draws fresh seeds for NumPy's and torch's generators (and drops a device seed the
   server queued: :func:`fresh_random_state`), and puts the
   wrapper's folder first on ``sys.path``, as ``python _worker.py`` does;
3. then it runs the worker wrapper's ``main`` (:mod:`multigpu.launch._worker`) with the same arguments, and
   leaves as the interpreter's exit would for everything the script made (its threads joined, ``atexit``
   handlers run, the modules it imported cleared so their objects are finalized, output flushed), without
   tearing down what it inherited from the launcher (:func:`_leave`).

What differs from a fresh interpreter: the worker's command line, as ``ps`` shows it, is the launcher's; the
modules the launcher had imported by then are imported already; the string hash seed is the launcher's (the
same on every rank of a node); and a variable read only when the interpreter or a library started (``PYTHON*``,
``LD_PRELOAD``) has the launcher's value, which is the environment the workers inherit anyway. Where the
fork server cannot be used (not Linux, a launcher called from other code, a worker command that is not the
wrapper, a Python thread already running) the agent starts the worker as before; a server that fails the launcher
(it died, did not answer within :data:`_REPLY_S`, could not fork, or a module it preloaded started a thread) is
stopped, one line says so, and this worker and the later ones are started as before: the job goes on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from subprocess import TimeoutExpired

__all__ = ["ForkedProcess", "available", "fresh_random_state", "preload", "serving", "start"]

_PR_SET_PDEATHSIG = 1
_PR_GET_CHILD_SUBREAPER = 37
_REPARENT_S = 10.0
"""How long a new worker waits to be re-parented to the launcher (it takes microseconds)."""
_REPLY_S = 120.0
"""How long the launcher waits for the server to fork a worker: it may first be importing what it was asked to
preload (``torch._dynamo``: seconds on a busy machine). Past it the server is given up (workers start as new
interpreters) rather than the job waiting on it."""
_THREADED = 1 << 20
"""The server's reply (negated) when it will not fork: it runs a Python thread besides its own (a preloaded module
started one), and a fork would copy that thread's locks held, not the thread."""

_SERVER: _Server | None = None


class _Server:
    """The launcher's end: a socket to the fork server (one request at a time)."""

    def __init__(self, sock: socket.socket, pid: int):
        self.sock = sock
        self.pid = pid
        self.lock = threading.Lock()

    def fork(self, request: dict, fds: list[int]) -> int:
        """A new worker's pid, re-parented to this process. Raises OSError when the server is gone, did not answer
        within :data:`_REPLY_S`, or could not fork (the caller then gives it up: :func:`_give_up`)."""
        data = json.dumps(request).encode()
        with self.lock:
            self.sock.settimeout(_REPLY_S)
            try:
                socket.send_fds(self.sock, [len(data).to_bytes(8, "little"), data], fds)
                reply = _read_exact(self.sock, 8)
            except TimeoutError as exc:
                raise OSError(f"the fork server did not answer within {_REPLY_S:g} s") from exc
            except ConnectionError as exc:  # it ended (killed: by the OOM killer, say)
                raise OSError(f"the fork server is gone: {exc.strerror or exc}") from exc
            finally:
                with contextlib.suppress(OSError):
                    self.sock.settimeout(None)
        pid = int.from_bytes(reply, "little", signed=True)
        if pid == -_THREADED:
            raise OSError("the fork server has started a thread (a module it imported for the workers did), "
                          "and a fork would copy that thread's locks")
        if pid <= 0:
            raise OSError(f"the fork server could not fork a worker: {os.strerror(-pid) if pid else 'unknown'}")
        return pid


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError("the fork server is gone")
        data += chunk
    return data


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _threads() -> int:
    """How many Python threads this process runs. A fork copies only the calling thread; a lock another one held
    (logging's, a buffered stream's, the import lock of a module it was importing) stays held in the copy for good.
    The native pools that loading torch and NumPy starts (OpenBLAS's, sized by ``OMP_NUM_THREADS``) are not counted:
    they idle, and OpenBLAS remakes its pool in a forked child (``pthread_atfork``)."""
    return threading.active_count()


def _is_subreaper() -> bool:
    value = ctypes.c_int(0)
    try:
        return _libc().prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0) == 0 and value.value != 0
    except (OSError, AttributeError):
        return False


def start() -> None:
    """Fork the fork server (Linux; once per process; call before anything else of the command)."""
    global _SERVER
    if _SERVER is not None or not sys.platform.startswith("linux") or not hasattr(socket, "send_fds"):
        return
    if _threads() > 1:  # something started a Python thread already: a fork copies its locks, held, without it
        return
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()  # nothing buffered may be written twice
    try:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # out of descriptors, say: the workers start as new interpreters
        return
    launcher = os.getpid()
    # a Ctrl-C must not reach the server before it blocks SIGINT itself: born with it blocked (pending in the
    # launcher until the mask is put back, then handled there as usual)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        pid = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        ours.close()
        theirs.close()
        return
    if pid:  # the launcher
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        theirs.close()
        _SERVER = _Server(ours, pid)
        atexit.register(_stop)  # the server leaves with the launcher, not a moment after
        return
    # the command's start-up handler (one line and exit 130, multigpu._startup) is the launcher's: a worker's
    # Ctrl-C is KeyboardInterrupt, as in a new interpreter, which the worker wrapper turns into its quiet exit
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.excepthook = sys.__excepthook__
    ours.close()
    request = None
    try:
        request = _serve(theirs, launcher)  # returns only in a new worker
    except BaseException:  # noqa: BLE001 - the server never returns into the launcher's code
        os._exit(1)
    if request is None:
        os._exit(0)
    inherited = frozenset(sys.modules)
    code = _run_worker(*request)
    _leave(code, inherited)


def _stop() -> None:
    """End the server with the launcher: it holds nothing (its workers are the launcher's children), and it may be
    busy importing what it was asked to preload for a job that a bad input ended first."""
    global _SERVER
    server, _SERVER = _SERVER, None
    if server is None:
        return
    server.sock.close()
    with contextlib.suppress(OSError):
        os.kill(server.pid, signal.SIGKILL)
        os.waitpid(server.pid, 0)


def _give_up(why: str) -> None:
    """The server failed the launcher: stop it, say so in one line, and start workers as new interpreters from now
    on (the job goes on; only their start is slower)."""
    if _SERVER is None:
        return
    _stop()
    print(f"multigpu: note: workers start as new interpreters ({why})", file=sys.stderr, flush=True)


# -- the fork server ------------------------------------------------------------------------------------------------

def _serve(sock: socket.socket, launcher: int) -> tuple[dict, list[int], int] | None:
    """Fork a worker per request until the launcher closes its end; returns (in the worker) its request."""
    with contextlib.suppress(OSError, AttributeError):
        _libc().prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher:
        os._exit(0)
    # Ctrl-C on the terminal reaches this process too (the launcher's group): blocked here, and so in every
    # worker at birth (the worker wrapper unblocks it first thing, as it does after a Popen)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    while True:
        try:
            head, fds, _, _ = socket.recv_fds(sock, 8, 3)
            if not head:
                return None
            head += _read_exact(sock, 8 - len(head))  # a stream may hand over the length in parts
        except OSError:
            return None
        request = json.loads(_read_exact(sock, int.from_bytes(head, "little")))
        if "preload" in request:  # no reply: the launcher goes on meanwhile
            _import(request["preload"])
            continue
        pid = _fork_worker(sock, fds, launcher) if _threads() == 1 else -_THREADED  # a preloaded module started one
        if pid == 0:  # the new worker
            return request, fds, launcher
        for fd in fds:
            os.close(fd)
        sock.sendall(pid.to_bytes(8, "little", signed=True))


def _import(modules: list[str]) -> None:
    """In the server: import ``modules`` (one that fails is left to the workers, which will say why), then freeze
    what they made, as what the launcher imported before the fork is."""
    import gc
    import importlib

    for name in modules:
        with contextlib.suppress(BaseException):
            importlib.import_module(name)
    gc.freeze()


def _fork_worker(sock: socket.socket, fds: list[int], launcher: int) -> int:
    """In the server: the new worker's pid, or -errno; 0 in the worker itself."""
    read_end, write_end = os.pipe()
    try:
        middle = os.fork()
    except OSError as exc:
        os.close(read_end)
        os.close(write_end)
        return -(exc.errno or 1)
    if middle == 0:  # forks the worker and leaves at once: the worker is re-parented to the launcher
        try:
            worker = os.fork()
        except OSError:
            os._exit(1)
        if worker:
            os._exit(0)
        os.setsid()  # before the launcher knows the pid: torch's agent signals the worker's process group
        os.close(read_end)
        os.write(write_end, os.getpid().to_bytes(8, "little"))
        os.close(write_end)
        sock.close()
        return 0
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read(8)
    os.waitpid(middle, 0)  # once reaped, the worker's parent is the launcher
    return int.from_bytes(data, "little") if len(data) == 8 else -1


# -- in the new worker ----------------------------------------------------------------------------------------------

def _run_worker(request: dict, fds: list[int], launcher: int) -> int:
    """Become the worker the request describes and run the worker wrapper; returns its exit code."""
    deadline = time.monotonic() + _REPARENT_S
    while os.getppid() != launcher:  # the middle process has exited; the kernel re-parents in microseconds
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.001)
    for target, fd in enumerate(fds):  # the launcher's stdin, stdout, stderr (or torch's log files)
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)
    _close_inherited_descriptors()
    if isinstance(request.get("umask"), int):
        os.umask(request["umask"])  # the launcher's now (0077 while a command runs), not the one at its start
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    _thread_counts(os.environ)
    from multigpu.launch import heap

    heap.apply(os.environ)  # glibc read its thresholds when the launcher started, without them
    fresh_random_state()
    from multigpu.launch import _worker

    argv = request["argv"]
    if not getattr(sys.flags, "safe_path", False):
        sys.path[0:1] = [os.path.dirname(_worker.__file__)]  # `python _worker.py`'s first entry, which it removes
    sys.argv = [_worker.__file__, *argv]
    try:
        _worker.main(argv)
    except SystemExit as exc:
        return _exit_code(exc.code)
    return 0


def fresh_random_state() -> None:
    """Give this worker the random state a new interpreter starts with: a fork copied the server's, so every rank of
    a node drew the same "random" numbers (issue 48).

    * Python's ``random``: CPython reseeds its global generator in every forked child itself (``os.register_at_fork``).
    * NumPy's legacy global generator (``numpy.random.rand``): seeded here from the OS, as at its import. A
      ``numpy.random.default_rng()`` made without a seed reads the OS each time already.
    * torch's CPU default generator: seeded here from the OS, as torch seeds it in a new process
      (``at::detail::getDefaultCPUGenerator``).
    * torch's device generators (CUDA's, XPU's, MTIA's): never started in the server (nothing there may start a
      device), so torch seeds each from the OS when the worker first uses it, as in a new process; a seed the server
      set meanwhile (``torch.manual_seed`` in a module it preloaded) waits in torch's queue for the device's start, and
      is dropped here.

    The string hash seed cannot change in a running interpreter: it stays the launcher's (docs/launching.md)."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    torch.default_generator.seed()
    try:
        from torch._utils import _LazySeedTracker
    except ImportError:  # another torch: its queue, if any, is left as it is
        return
    for name in ("torch.cuda", "torch.xpu", "torch.mtia"):
        module = sys.modules.get(name)
        if module is not None and isinstance(getattr(module, "_lazy_seed_tracker", None), _LazySeedTracker):
            module._lazy_seed_tracker = _LazySeedTracker()


def _close_inherited_descriptors() -> None:
    """Close what a ``Popen(close_fds=True)`` worker would not have: the inheritable descriptors above 2 (those the
    launcher's own parent passed it: a CI runner's pipe, a terminal's). A pipe held so stayed open as long as a
    worker lived. The non-inheritable ones are the launcher's modules' (opened while they were imported) and stay."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2:
            with contextlib.suppress(OSError):
                if os.get_inheritable(fd):
                    os.close(fd)


def _leave(code: int, inherited: frozenset[str]) -> None:
    """End the worker as the interpreter's exit would for everything the script made, then ``os._exit``.

    A forked worker's normal exit tore down every module it inherited too, and each object it touched was a
    copy-on-write fault: 0.4-0.6 s after the script had ended (torch's modules are most of them). So: wait for
    the script's threads, run the ``atexit`` handlers (torch's, the script's, ``weakref.finalize``'s, logging's
    flush), clear the modules imported since the fork as the interpreter clears modules (their objects are
    finalized: files the script left open are flushed and closed), collect, flush Python's and C's buffered
    output, and leave without tearing down what the launcher had loaded, as a ``multiprocessing`` child does."""
    import atexit
    import gc

    for step in (threading._shutdown, atexit._run_exitfuncs):
        with contextlib.suppress(BaseException):
            step()
    for name in reversed([n for n in list(sys.modules) if n not in inherited and n != "__main__"]):
        module = sys.modules.pop(name, None)
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for first in (True, False):  # names with one leading underscore first, then the rest (CPython's order)
            for key in list(namespace):
                if key != "__builtins__" and (not first or (key.startswith("_") and not key.startswith("__"))):
                    with contextlib.suppress(BaseException):
                        namespace[key] = None
    with contextlib.suppress(BaseException):
        gc.collect()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(BaseException):
            stream.flush()
    with contextlib.suppress(BaseException):
        _libc().fflush(None)
    os._exit(code)


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _thread_counts(env) -> None:
    """The thread counts the worker's environment asks for: OpenMP's (torch) and OpenBLAS's (NumPy) read it when
    the launcher loaded them."""
    wanted = env.get("OMP_NUM_THREADS", "")
    if wanted.isdigit() and int(wanted) > 0:
        import torch

        if torch.get_num_threads() != int(wanted):
            torch.set_num_threads(int(wanted))
    blas = next((env[k] for k in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS")
                 if env.get(k, "").isdigit() and int(env[k]) > 0), None)
    if blas is not None:
        _openblas_threads(int(blas))


def _openblas_threads(n: int) -> None:
    """``openblas_set_num_threads(n)`` in every OpenBLAS this process has loaded (NumPy's, SciPy's)."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {line.split()[-1] for line in fh if "openblas" in line.lower() and "/" in line}
    except OSError:
        return
    for path in paths:
        with contextlib.suppress(OSError):
            lib = ctypes.CDLL(path)
            for name in ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                         "openblas_set_num_threads64_"):
                if hasattr(lib, name):
                    getattr(lib, name)(ctypes.c_int(n))
                    break


# -- in the launcher: torch's agent gets forked workers -------------------------------------------------------------

def preload(modules) -> None:
    """Have the fork server import ``modules`` now, while the launcher goes on (checks the config, meets the other
    nodes): the workers it forks afterwards have them, instead of each importing them (``torch._dynamo``, which
    any ``torch.optim`` optimizer imports when it is made, is 1-1.5 CPU-seconds per rank). Nothing without a server;
    nothing is awaited (a worker asked for later is forked once the imports are done)."""
    modules = [m for m in modules if m]
    if _SERVER is None or not modules:
        return
    data = json.dumps({"preload": modules}).encode()
    with _SERVER.lock, contextlib.suppress(OSError):
        _SERVER.sock.sendall(len(data).to_bytes(8, "little") + data)


def _umask() -> int:
    """This process's umask, read without setting it (another thread may be creating files meanwhile)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    current = os.umask(0o077)
    os.umask(current)
    return current


def available() -> bool:
    """A fork server runs and this process is a child subreaper (workers can be re-parented to it)."""
    return _SERVER is not None and _is_subreaper()


class ForkedProcess:
    """The part of ``subprocess.Popen`` torch's agent uses, for a worker this process did not exec."""

    def __init__(self, pid: int, args):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: its status is lost
                self.returncode = 1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutExpired(self.args, timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _worker_argv(entrypoint: str, args) -> list[str] | None:
    """The wrapper's arguments when the agent is to start ``python -u <_worker.py> ...``, else None."""
    from multigpu.launch import _worker

    args = [str(a) for a in args]
    if entrypoint == sys.executable and args[:2] == ["-u", _worker.__file__]:
        return args[2:]
    return None


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """While a job runs: the agent's workers come from the fork server when it can give them."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

    if _SERVER is None:
        yield
        return
    original = api.get_subprocess_handler

    class ForkedHandler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]):
            argv = _worker_argv(args[0], args[1:])
            if argv is None or not available():
                return super()._popen(args, env)
            streams = [0, self._stdout.fileno() if self._stdout else 1, self._stderr.fileno() if self._stderr else 2]
            request = {"argv": argv, "env": dict(env), "cwd": os.getcwd(), "umask": _umask()}
            try:
                return ForkedProcess(_SERVER.fork(request, streams), args)
            except OSError as exc:
                _give_up(str(exc))
                return super()._popen(args, env)

    def forked(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options=None):
        if numa_options is not None or _worker_argv(entrypoint, args) is None:
            return original(entrypoint, args, env, stdout, stderr, local_rank_id, numa_options)
        return ForkedHandler(entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                             local_rank_id=local_rank_id, numa_options=None)

    api.get_subprocess_handler = forked
    try:
        yield
    finally:
        api.get_subprocess_handler = original

