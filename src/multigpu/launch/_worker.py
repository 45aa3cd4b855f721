"""The wrapper every worker runs first (inside each rank, before the user's script).

The launcher starts ``python -u <this file> [-m] target args...`` in each
worker (or forks the worker from its fork server, which then calls :func:`main` with
the same arguments: :mod:`multigpu.launch.forkserver`). Run by path, it imports nothing
of multigpu or torch before it has:

0. tied its life to the launcher's: ``PR_SET_PDEATHSIG`` (Linux) makes the
   kernel SIGKILL this worker the moment the launcher dies, whatever killed it
   (SIGKILL and the OOM killer included); a launcher that died before that
   line ran is caught by comparing the parent with ``MULTIGPU_LAUNCHER_PID``.
   Where ``prctl`` is missing, a daemon thread watches the parent pid and
   kills this worker's process group when it changes;
1. under ``--isolate-devices`` (``MULTIGPU_DEVICE_MAP`` set), set ``CUDA_VISIBLE_DEVICES``,
   ``QD_VISIBLE_DEVICE``, ``TI_VISIBLE_DEVICE`` and ``EGL_DEVICE_ID`` to this
   worker's physical GPU, so simulators that read them at import see one GPU;
   in a hybrid job (the run file's ``gpu_ranks``), set them empty for the CPU
   ranks, so that nothing in a CPU rank (FSDP's default mesh, a library's
   ``torch.cuda`` call) can land on a GPU;
2. take its own folder off ``sys.path`` (its ``agent.py``, ``config.py`` would
   shadow the user's modules), and import torch with neither that folder nor
   the working directory on ``sys.path``; then, for a script, put the script's
   folder first, as ``python script.py`` does; for ``-m module``, put the
   working directory *last*, not first as ``python -m`` does, so a
   ``psutil.py`` or ``json.py`` lying there cannot stand in for the installed
   module (a module or package of the working directory is still found when
   nothing installed has its name; ``-P``/``PYTHONSAFEPATH`` leaves it out);
3. arrange that ``SIGUSR1`` and ``SIGTERM`` (what torch's agent sends to the
   surviving workers when one fails) first write every thread's Python stack
   to ``$MULTIGPU_STACKS_DIR/rank<R>.txt``, so the launcher can say where
   each rank stood;

4. reserve its error file (``TORCHELASTIC_ERROR_FILE``): a placeholder that
   reads as "no error" padded to :data:`ERROR_FILE_RESERVE` bytes, which the
   error is later written over in place, so a disk that fills up during the run
   (the usual reason a rank fails late) cannot leave the file empty and the
   launcher without the cause;

then it gives a script the user's umask back (the launcher runs under 0077, so that its logs, stack dumps
and run files are the user's only, and the worker inherited that; a workload's ranks keep it: what they
write is the run's), and runs the script as ``__main__`` under torch's ``record`` decorator, so
an exception lands in the worker's error file with its traceback, which the
launcher summarises; a rank whose script failed (an exception, ``sys.exit(N)``
with N != 0, Ctrl-C) then ends at once, past the interpreter's teardown
(``_leave``: ``atexit`` functions run first). A ``KeyboardInterrupt`` that reaches the top (Ctrl-C on
the launcher sends SIGINT to every worker) ends the worker with exit code 130
and no traceback: the launcher says "interrupted" once for the whole job
(``MULTIGPU_DEBUG=1``, set by ``multigpu --debug``, shows the tracebacks). Workers
are born with SIGINT blocked (see :mod:`multigpu.launch.processes`), and unblocking
it is the first thing this wrapper does, inside that handler: a Ctrl-C while the
interpreter was still starting (importing ``site``, a fatal error there) ends the
worker the same way, or, where the worker is still starting when the agent stops the workers, the SIGTERM the
launcher sends it then does (its default action: nothing printed).
Before the script runs it also notes, in ``<stacks dir>/joined/rank<R>``, the first time this rank joins a
process group (``torch.distributed.init_process_group``, which ``mg.init``, accelerate, Lightning and
``init_device_mesh`` all reach), so the launcher can tell a job from N independent copies of a script; and it
installs :mod:`multigpu.launch._script_checks`: workers the script spawns itself (``torch.multiprocessing.spawn``)
refuse to join a process group with one line, and rank 0 is told at its first optimizer step that it trains with no
process group (or at once, with a group of one) in a job of several ranks.
When the run context asks for it (``record_wall``: ``multigpu bench`` on a
script that has no step meter), it also writes ``<run_dir>/wall/rank<R>.json``
with the script's start and end times.
It also notes when this rank's process began, when it had imported torch and was about to run the script, and when
it joined its process group, in ``<stacks dir>/startup/rank<R>.json`` (:mod:`multigpu.monitor.startup` reads them:
where a run's start-up went).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import runpy
import sys
import time

DEVICE_VARIABLES = ("CUDA_VISIBLE_DEVICES", "QD_VISIBLE_DEVICE", "TI_VISIBLE_DEVICE", "EGL_DEVICE_ID")
"""Set together, per worker, under ``--isolate-devices``: CUDA, Quadrants/Taichi (Genesis), EGL renderers."""

# Copies of multigpu.envvars (which documents them): this file runs before anything of multigpu may be imported
# (multigpu's package imports torch); tests/unit/test_envvars.py holds them equal.
LAUNCHER_PID_VAR = "MULTIGPU_LAUNCHER_PID"
DEVICE_MAP_VAR = "MULTIGPU_DEVICE_MAP"
RUN_FILE_VAR = "MULTIGPU_RUN_FILE"
STACKS_DIR_VAR = "MULTIGPU_STACKS_DIR"
DEBUG_VAR = "MULTIGPU_DEBUG"

ERROR_FILE_RESERVE = 64 << 10
"""Bytes reserved for the error file at start (a traceback's tail and the message fit; longer ones are cut)."""

_NO_ERROR = '{"message": "<NONE>", "timestamp": 9999999999}'
"""What torch's agent reads from a worker that wrote no error (killed, or stopped by the agent): as if there
were no file. Its far-future timestamp keeps it from being taken for the first failure (torch picks the
earliest; a missing file reads as "now", a missing timestamp as 0, i.e. first)."""




STARTUP_DIR = "startup"
"""Under the stacks dir: ``rank<R>.json``, this rank's start-up marks (see :func:`_note`)."""


def process_start_time(pid: int | str = "self") -> float | None:
    """When a process began, as ``time.time()`` would have read then (Linux, to the kernel's 10 ms tick); None elsewhere.

    Its age from ``/proc/<pid>/stat`` (start time in ticks since boot) against ``CLOCK_BOOTTIME`` now: the boot
    time in ``/proc/stat`` (what ``psutil``'s ``create_time`` adds) is whole seconds, too coarse for a start-up."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])  # field 22, counted after the command's ")"
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - max(age, 0.0)


_MARKS: dict[str, float | None] = {}


def _note(name: str, value: float | None = None) -> None:
    """Record a start-up mark of this rank and rewrite ``<stacks dir>/startup/rank<R>.json`` (best effort)."""
    _MARKS[name] = time.time() if value is None else value
    folder = os.environ.get(STACKS_DIR_VAR)
    if not folder:
        return
    path = os.path.join(folder, STARTUP_DIR, f"rank{os.environ.get('RANK', '0')}.json")
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        _write_json(path, _MARKS)


def _write_json(path: str, data) -> None:
    """Write ``data`` as JSON to ``path`` whole: the job's file (0600, also once a script runs under the user's own
    umask), through a temporary beside it created new (``O_EXCL``), never through a link (``O_NOFOLLOW``), with a name
    no one can guess (the folder may be a ``--log-dir`` another user can write to), then renamed over ``path``."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.urandom(6).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with open(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def worker_device_env(env, local_rank: int, gpu_ranks: int | None = None) -> dict[str, str]:
    """The device variables one worker sets for itself (none: it keeps what it inherited).

    Isolated: the four variables name its own GPU, or none for a rank beyond the GPU list. Hybrid: a CPU rank
    (``local_rank`` at or beyond ``gpu_ranks``, from the run file) sees no GPU."""
    if env.get(DEVICE_MAP_VAR):
        ids = [i for i in env[DEVICE_MAP_VAR].split(",") if i]
        value = ids[local_rank] if local_rank < len(ids) else ""
        return {name: value for name in DEVICE_VARIABLES}
    if gpu_ranks is not None and local_rank >= gpu_ranks:
        return {name: "" for name in DEVICE_VARIABLES}
    return {}


_HERE = os.path.dirname(os.path.abspath(__file__))

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PARENT_POLL_S = 0.5


def _die_with_launcher(launcher_pid: int | None) -> None:
    """Never outlive the launcher: the kernel's parent-death signal, or a thread that watches the parent."""
    import signal

    if launcher_pid is None:
        return  # started by hand (tests, debugging): there is no launcher to follow
    armed = False
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != launcher_pid:  # the launcher died before the line above took effect
        os.kill(os.getpid(), signal.SIGKILL)
    if not armed:
        import threading
        import time

        def watch() -> None:
            while os.getppid() == launcher_pid:
                time.sleep(_PARENT_POLL_S)
            if os.getpgrp() == os.getpid():  # the agent starts each worker as the leader of its own group
                os.killpg(os.getpgrp(), signal.SIGKILL)  # this worker and every process it started
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="multigpu-parent-watch", daemon=True).start()


def _launcher_pid() -> int | None:
    text = os.environ.get(LAUNCHER_PID_VAR, "")
    return int(text) if text.isdigit() else None


def _run(argv: list[str]) -> None:
    if argv and argv[0] == "-m":
        module, args = argv[1], argv[2:]
        sys.argv = [module, *args]
        cwd = os.getcwd()
        if not getattr(sys.flags, "safe_path", False) and all(os.path.abspath(p or ".") != cwd for p in sys.path):
            sys.path.append(cwd)  # last: installed modules win over same-named files here
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = argv[0], argv[1:]
        sys.argv = [script, *args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
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


def _reserve_error_file(path: str | None) -> None:
    """Write the placeholder, padded: the bytes the error will be written over later (best effort)."""
    if not path:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(_NO_ERROR.ljust(ERROR_FILE_RESERVE))
    except OSError:
        pass  # already full: torch's own write may still get through; the launcher names an empty file


def _error_json(e: BaseException, limit: int) -> bytes:
    """torch's error-file record of ``e`` (the same fields), its traceback cut from the top to fit ``limit``."""
    import json
    import time
    import traceback

    stack, message = traceback.format_exc(), f"{type(e).__name__}: {e}"
    while True:
        data = json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": stack, "timestamp": str(int(time.time()))}}}).encode()
        if len(data) <= limit or len(message) <= 16:
            return data
        if stack:  # the top of the stack goes first, then the end of a very long message
            stack = stack[max(len(data) - limit, len(stack) // 4):] if len(stack) > 64 else ""
        else:
            message = message[: max(len(message) - (len(data) - limit) - 16, 0)] + " [cut]"


def _write_in_place(path: str, data: bytes) -> None:
    """Overwrite the reserved file from its start, then cut it to ``data``: no new blocks are needed."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def _error_handler():
    """torch's ErrorHandler, writing the error into the file reserved at start instead of a new one."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    class InPlace(ErrorHandler):
        def record_exception(self, e: BaseException) -> None:
            path = self._get_error_file_path()
            try:
                size = os.path.getsize(path) if path else 0
            except OSError:
                size = 0
            if size < len(_NO_ERROR):  # nothing reserved: torch's own way
                super().record_exception(e)
                return
            try:
                _write_in_place(path, _error_json(e, size))
            except OSError:  # a copy-on-write file system may still want blocks: the message alone, then give up
                with contextlib.suppress(OSError):
                    _write_in_place(path, json.dumps({"message": {"message": f"{type(e).__name__}: {e}"}}).encode())

    return InPlace()


_GROUPS: list = []
"""The process groups the script made (torch's Python objects), each held while something else may hold it:
see :func:`_hold_groups`."""


def _hold_groups() -> None:
    """Keep a Python reference to every process group the script makes, for as long as something else may hold it.

    A DDP model's reducer holds its group in C++. Once the script has destroyed the group
    (``destroy_process_group``), the reducer can be the group's last holder, and freeing the model (``main()``
    returning, say) then runs gloo's destructor on this thread with the interpreter lock held; it joins gloo's
    threads. One of them may be freeing the last allreduce of a backward pass: that work holds a copy of the
    thread-local state, with the Python object torch's backward stashes there, and freeing it needs the lock.
    Neither moves again (``multigpu bench`` hung so on pytorch/examples' DDP tutorial, one run in four). A group
    freed through its Python object lets the lock go first (torch's holder for process groups does), so while
    this reference lives the reducer never frees the group: it goes when the script destroys it and nothing else
    holds its Python object (no DDP model is alive: a DDP model keeps it as ``process_group``), else once the
    script has ended (:func:`_release_groups`).
    """
    from torch.distributed import distributed_c10d

    helper = getattr(distributed_c10d, "_new_process_group_helper", None)
    destroy = distributed_c10d.destroy_process_group
    if helper is None or getattr(helper, "__wrapped__", None) is not None:
        return  # another torch: nothing to hold by (the reducer frees the group as before)

    def _new_process_group_helper(*args, **kwargs):
        result = helper(*args, **kwargs)
        group = result[0] if isinstance(result, tuple) else result
        if isinstance(group, distributed_c10d.ProcessGroup):
            _GROUPS.append(group)
        return result

    def destroy_process_group(*args, **kwargs):
        destroy(*args, **kwargs)
        _drop_unheld_groups(distributed_c10d)

    _new_process_group_helper.__wrapped__ = helper
    distributed_c10d._new_process_group_helper = _new_process_group_helper
    _replace(distributed_c10d, "destroy_process_group", destroy, destroy_process_group)


def _drop_unheld_groups(distributed_c10d) -> None:
    """Let go of the destroyed groups whose Python object nothing else holds (freed now, the lock let go)."""
    live = distributed_c10d._world.pg_map
    keep = []
    while _GROUPS:
        group = _GROUPS.pop()
        # 2: this name and getrefcount's argument; more: a DDP model (or anything else) still holds it
        if group in live or sys.getrefcount(group) > 2:
            keep.append(group)
        del group
    _GROUPS.extend(reversed(keep))


def _release_groups() -> None:
    """Free every group :func:`_hold_groups` kept, through their Python objects (the interpreter lock let go)."""
    _GROUPS.clear()


def _replace(module, name: str, original, wrapper) -> None:
    """Put ``wrapper`` in place of ``original`` under ``name`` wherever scripts find it (torch.distributed
    re-exports torch.distributed.distributed_c10d's functions; device_mesh imports some)."""
    import torch.distributed as dist

    wrapper.__wrapped__ = original
    wrapper.__doc__ = original.__doc__
    for namespace in (module, dist, sys.modules.get("torch.distributed.device_mesh")):
        if namespace is not None and getattr(namespace, name, None) is original:
            setattr(namespace, name, wrapper)


def _note_group_joins(folder: str | None, rank: str, joined=None) -> None:
    """Write ``<folder>/joined/rank<R>`` when this rank first joins a process group (see the module docstring),
    then call ``joined()`` (when given) each time it has made one."""
    if not folder:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    original = distributed_c10d.init_process_group

    def init_process_group(*args, **kwargs):
        result = original(*args, **kwargs)
        if joined is not None:
            joined()
        marker = os.path.join(folder, "joined", f"rank{rank}")
        if not os.path.exists(marker):
            os.makedirs(os.path.dirname(marker), mode=0o700, exist_ok=True)
            os.close(os.open(marker, os.O_WRONLY | os.O_CREAT, 0o600))  # the job's file: not the script's umask
        if "group_joined" not in _MARKS:
            _note("group_joined")
        return result

    init_process_group.__wrapped__ = original
    init_process_group.__doc__ = original.__doc__
    # every name a caller may have bound it under (torch.distributed re-exports it; device_mesh imports it)
    for namespace in (distributed_c10d, dist, sys.modules.get("torch.distributed.device_mesh")):
        if namespace is not None and getattr(namespace, "init_process_group", None) is original:
            namespace.init_process_group = init_process_group


def _accelerate_on_cpu_ranks() -> None:
    """On CPU ranks (``ACCELERATE_USE_CPU`` set by the launcher), make accelerate's ``PartialState()`` join
    the job too.

    accelerate's ``Accelerator`` reads ``ACCELERATE_USE_CPU``; its ``PartialState`` does not, and with
    ``cpu=False`` on a machine without a GPU it settles on ``DistributedType.NO``: every rank a separate
    single-process copy (under ``accelerate launch --cpu`` too). Where every rank is a CPU rank, ``cpu=False``
    cannot mean anything else, so ``PartialState``'s default becomes ``cpu=True`` when accelerate is imported
    (nothing is imported here otherwise). ``ACCELERATE_USE_CPU=false`` in the environment turns this off.
    """
    if os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes"):
        return

    def patch(module) -> None:
        init = module.PartialState.__init__

        def __init__(self, cpu: bool = True, **kwargs):
            init(self, cpu, **kwargs)

        module.PartialState.__init__ = __init__

    _after_import(("accelerate.state",), patch)


def _after_import(names: tuple[str, ...], patch) -> None:
    """Call ``patch(module)`` right after any of the modules ``names`` is imported (nothing is imported here)."""
    import importlib.abc
    import importlib.machinery

    class _PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname not in names:
                return None
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchAfterImport())


def _fabric_on_cpu_ranks() -> None:
    """Lightning Fabric's ``devices="auto"`` on CPU ranks counts the processes the launcher started on this node.

    Fabric counts one CPU device for "auto" (``CPUAccelerator.auto_device_count``), so under a launch of N CPU
    ranks per node a script with ``Fabric(devices="auto")`` (its default) ran as N single-process copies, each on
    all the data. Here a CPU "device" is a process, and the launcher has decided how many: ``LOCAL_WORLD_SIZE``.
    (On GPUs "auto" stays the GPU count, which is the job's only when every visible GPU has a rank.)
    """
    try:
        count = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return
    if count < 2:
        return

    def patch(module) -> None:
        module.CPUAccelerator.auto_device_count = staticmethod(lambda: count)

    _after_import(("lightning_fabric.accelerators.cpu", "lightning.fabric.accelerators.cpu"), patch)


def _run_file() -> dict:
    """The launcher's ``run.json`` ({} without one, or unreadable: the runtime reports that when it reads it)."""
    import json

    path = os.environ.get(RUN_FILE_VAR)
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _wall_file(run_file: dict) -> str | None:
    """``<run_dir>/wall/rank<R>.json`` when the run context asks for the script's wall time, else None."""
    ctx = run_file.get("run", {})  # the run context, as a dict
    if not isinstance(ctx, dict) or not ctx.get("record_wall") or not ctx.get("run_dir"):
        return None
    return os.path.join(ctx["run_dir"], "wall", f"rank{os.environ.get('RANK', '0')}.json")


def _timed(target, wall_file: str | None):
    """``target`` wrapped to write its start and end (``time.time()``) to ``wall_file``, when given."""
    if wall_file is None:
        return target

    def run(argv: list[str]) -> None:
        import time

        start = time.time()
        target(argv)
        end = time.time()
        os.makedirs(os.path.dirname(wall_file), mode=0o700, exist_ok=True)
        _write_json(wall_file, {"start": start, "end": end, "marks": _MARKS})

    return run


def _destroy_left_group() -> None:
    """Destroy the default process group a script that ended well left behind (accelerate's scripts, and many plain
    ones, never call ``destroy_process_group``): torch would free it during the interpreter's exit, where gloo's
    threads have aborted a finished rank ("terminate called without an active exception", exit -6, seen with
    accelerate's ``Accelerator``). Only after success: a failing rank leaves at once (its
    peers may be stuck in a collective that a destroy would wait on)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        gc.collect()  # the script's dropped DDP models first, on this thread (see multigpu.runtime.group.shutdown)
        with contextlib.suppress(Exception):  # ending is all that is left to do: never fail a finished rank here
            dist.destroy_process_group()


LEAVE_DEFAULT_S = 600.0
"""How long a rank whose script has ended may take to exit when the run sets neither ``--stall-timeout-s`` nor
``--timeout-s`` (the collective timeout's own default)."""


def _leave_within(run_file: dict, rank: str) -> None:
    """Give this rank a deadline to exit, now that its script has ended well: the stall timeout, else the
    collective timeout (a rank that is leaving makes no progress, and waits on nothing that may take longer).

    What keeps a finished rank alive waits with the interpreter lock held as often as not (a library's
    destructor joining its threads), where no Python thread can act; faulthandler's timer is a C thread that
    needs no lock. When it fires, every thread's stack goes to this rank's stacks file and the process exits
    with code 1, and the launcher reads the line written here into the error file beforehand.
    """
    import faulthandler
    import time

    ctx = run_file.get("run", {}) if isinstance(run_file.get("run"), dict) else {}  # the run context, as a dict
    seconds = next((float(v) for v in (ctx.get("stall_timeout_s"), ctx.get("timeout_s"))
                    if isinstance(v, (int, float)) and v > 0), LEAVE_DEFAULT_S)
    where = _STACK_FILE.name if _STACK_FILE is not None else "its stderr"
    message = (f"rank {rank}: its script ended, but the process did not exit within {seconds:g} s (--stall-timeout-s, "
               "else --timeout-s): something it left waits forever (a thread the script started that never "
               f"ends, or a library's shutdown); where each thread stood: {where}")
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        record = {"message": {"message": message, "extraInfo": {"py_callstack": "", "timestamp": str(int(time.time()))}}}
        with contextlib.suppress(OSError):
            _write_in_place(path, json.dumps(record).encode())
    faulthandler.dump_traceback_later(seconds, exit=True, file=_STACK_FILE or sys.stderr)


def main(argv: list[str]) -> None:
    try:
        # born with SIGINT blocked (the launcher's processes.py): a Ctrl-C during the interpreter's start-up
        # is pending, and raises KeyboardInterrupt here, where it ends this worker quietly
        import signal

        if hasattr(signal, "pthread_sigmask"):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        _main(argv)
    except KeyboardInterrupt:
        if os.environ.get(DEBUG_VAR) == "1":
            raise
        _leave(130)  # the launcher reports the interrupt once, for the whole job


def _exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(code)`` gives the process (Python prints a code that is not a number, and gives 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    with contextlib.suppress(Exception):
        print(exc.code, file=sys.stderr)
    return 1


def _leave(code: int) -> None:
    """End this failed rank now with ``code``, without the interpreter's teardown.

    A rank that failed may still hold its process group with a collective in flight (a DDP comm hook's
    all-reduce, whose future calls back into Python, that a peer never joins). Leaving through the
    interpreter's exit, the rank then waited in its finalization for that collective's timeout (the launcher
    saw it running, the job stood still), and gloo's thread, timing out into the Python callback while the
    interpreter was torn down, aborted the process: exit 1 became -6 (SIGABRT, "terminate called ..."). Here
    the error file is already written; what was registered with ``atexit`` runs and the output is flushed while
    the interpreter is whole, then the process ends at once."""
    import atexit

    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # the script's own (logging's flush, a tracker's finish), as at a normal exit
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _whole_lines() -> None:
    """Each line the script prints reaches the console in one write (``python -u`` writes ``print``'s text and its
    newline apart, and the ranks sharing the console broke each other's lines: thousands in 40,000 printed at once
    by two ranks). Line-buffered text streams flush at every newline, as a terminal's stdout does, so output still
    comes as it is printed; a line up to the pipe's atomic size (4 KiB) is never split by another rank's."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError, OSError):  # replaced or closed by an embedding process
            stream.reconfigure(line_buffering=True, write_through=False)


def _main(argv: list[str]) -> None:
    _MARKS["worker_start"] = process_start_time()
    _die_with_launcher(_launcher_pid())
    _whole_lines()
    run_file = _run_file()
    gpu_ranks = run_file.get("gpu_ranks")
    os.environ.update(worker_device_env(os.environ, int(os.environ.get("LOCAL_RANK", "0")),
                                        gpu_ranks if isinstance(gpu_ranks, int) else None))
    if sys.path and os.path.abspath(sys.path[0]) == _HERE:
        del sys.path[0]  # never let this folder shadow modules named config, agent, ...; _run adds the right one
    _register_stack_dumps(os.environ.get(STACKS_DIR_VAR), os.environ.get("RANK", "0"))
    _reserve_error_file(os.environ.get("TORCHELASTIC_ERROR_FILE"))

    # torch.distributed.nn before any script joins: imported after its group exists (DDP does, through dynamo), its
    # ``group=group.WORLD`` defaults would hold that group, which destroy_process_group() then never frees
    # (multigpu.runtime.group says more)
    before = time.perf_counter()
    import torch.distributed.nn  # noqa: F401
    from torch.distributed.elastic.multiprocessing.errors import record

    _MARKS["torch_import_s"] = time.perf_counter() - before  # ~0 where torch was imported already
    # torch's import leaves ~10^5 objects that live as long as the process; the collections at the interpreter's
    # exit traversed them all, ~0.4 CPU-seconds per rank after the script had ended. Frozen, they are skipped
    # (by every later collection too); what the script creates is collected, and finalized, as before.
    gc.freeze()

    # a script that spawns its own workers, or trains alone on every rank, is told so (not a silent hang or copies)
    from multigpu.launch import _script_checks

    rank, world_size = os.environ.get("RANK", "0"), _script_checks.world_size_from_env()
    _script_checks.install(world_size, rank)
    _note_group_joins(os.environ.get(STACKS_DIR_VAR), rank, lambda: _script_checks.group_of_one(world_size, rank))
    _hold_groups()
    _accelerate_on_cpu_ranks()
    _fabric_on_cpu_ranks()
    _note("worker_ready")

    if isinstance(run_file.get("umask"), int) and not run_file.get("workload"):
        os.umask(run_file["umask"])  # a user's script: the user's umask, not the launcher's (0077)
    try:
        try:
            record(_timed(_run, _wall_file(run_file)), error_handler=_error_handler())(argv)
            _destroy_left_group()
        finally:
            # a group the script destroyed can still be held by garbage (a DDP model is a reference cycle): free
            # it now, so gloo's threads end while the interpreter is whole, not during its exit
            gc.collect()
        _release_groups()  # the script ended well (a failing rank leaves at once, its groups untouched)
        _leave_within(run_file, os.environ.get("RANK", "0"))
    except SystemExit as exc:  # the script's sys.exit(N): a failure (N != 0) leaves the same way as an exception
        code = _exit_code(exc)
        if code:
            _leave(code)
        _release_groups()  # sys.exit(0): it ended well
        _leave_within(run_file, os.environ.get("RANK", "0"))
        raise
    except Exception:
        # torch's record() has written the traceback into this rank's error file; the launcher prints the
        # failing rank's own frames from it under its one-line summary. Printing it here as well put every
        # rank's whole traceback (33-190 lines) on the console before that summary.
        if os.environ.get(DEBUG_VAR) == "1" or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
            sys.excepthook(*sys.exc_info())
        _leave(1)


if __name__ == "__main__":
    main(sys.argv[1:])
