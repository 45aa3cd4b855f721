"""Start the job through torchrun's elastic agent and summarise failures (runs in the launcher).

``launch(cfg, target, args, ctx=..., job=...)`` resolves devices
(``devices.plan_devices``, unless the caller already did), writes the run file
(``run.json``: the workload and its config, if any, and the run context the
ranks read through :mod:`multigpu.runtime.context`), builds torch's
``LaunchConfig`` (c10d rendezvous; ``localhost:0`` on one node) and calls
``elastic_launch`` through :func:`_elastic_launch`, the one seam tests replace
with a mock. Nothing here spawns, rendezvous or restarts by itself: torch's
agent does all three, with the rendezvous backend of :mod:`multigpu.launch.stores`
(torch's c10d handler on stores that listen on the endpoint's address, not on
every interface, with the rendezvous state signed so that no one else's pickle
is ever read; :func:`launch` hands it the secret in memory and keeps it from the
workers). :mod:`multigpu.launch.processes` sees that no process of the
job outlives the launch and that a signal ends it the same way at any moment. When the
command line made a fork server (:mod:`multigpu.launch.forkserver`), the agent's workers
are forked from it, torch already imported, instead of started as new interpreters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig
from torch.distributed.launcher.api import elastic_launch

from multigpu import envvars
from multigpu.errors import (
    ConfigError,
    InterruptedBySignalError,
    LaunchError,
    MultigpuError,
    NodeFailedError,
    NodeLostError,
    RendezvousTimeoutError,
    WorkerFailedError,
)
from multigpu.files import user_umask, write_json_atomic
from multigpu.launch import _worker, forkserver, nodelogs, nodes, processes, quiet, restarts, stores
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import DevicePlan, HostFacts, plan_devices
from multigpu.launch.hints import assumption_hint
from multigpu.launch.memlimit import MemoryWatch, explain_address_space
from multigpu.launch.rendezvous import (
    gloo_interface,
    hosts_store,
    loopback_interface,
    parse_endpoint,
    secret_from_env,
)
from multigpu.launch.stacks import FRAME, is_library, read_positions
from multigpu.runtime.context import RunContext
from multigpu.units import format_bytes

__all__ = ["LaunchPlan", "build_plan", "launch", "summarize_failure"]

_TAIL_LINES = 6
NCCL_TRACE_DIR = "nccl_trace"
"""Under the log directory: NCCL's flight recorder dumps, one file per rank (``rank_<r>``), on a collective timeout."""
NCCL_TRACE_ENTRIES = "2000"
"""Collectives each rank's flight recorder keeps (torch's own default when it is on)."""


@dataclass(frozen=True)
class LaunchPlan:
    torch_config: TorchLaunchConfig
    entrypoint: str
    args: list[str]
    env: dict[str, str]
    devices: DevicePlan
    log_dir: str
    run_file: Path
    """Where ``launch`` writes ``run_data`` before the workers start."""
    run_data: dict
    """``{"workload", "config", "run"}``: what every rank reads (``MULTIGPU_RUN_FILE``)."""


def _check_target(target: str, module: bool) -> None:
    if module:
        if not target or not all(part.isidentifier() for part in target.split(".")):
            raise ConfigError(f"-m {target!r} is not a module name; valid: dotted.module.name")
        return
    path = Path(target)
    if not path.is_file():
        raise ConfigError(f"script '{target}' does not exist; give the path of a Python file, or -m module")



def run_context_for(cfg: LaunchConfig, devices: DevicePlan, ctx: RunContext | None = None) -> RunContext:
    """The command's run context completed with what the launcher flags and the device plan decided."""
    ctx = ctx or RunContext()
    return dataclasses.replace(
        ctx, timeout_s=cfg.timeout_s, stall_timeout_s=cfg.stall_timeout_s, profile=cfg.profile or ctx.profile,
        profile_steps=cfg.profile_steps, sample_interval_s=cfg.sample_interval_s,
        isolated=devices.isolated, allow_cpu_ranks=cfg.allow_cpu_ranks, hybrid=devices.hybrid,
        pg_backend="gloo" if devices.shared else ctx.pg_backend, elastic=cfg.elastic or ctx.elastic,
    )


def build_plan(
    cfg: LaunchConfig,
    target: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    facts: HostFacts | None = None,
    devices: DevicePlan | None = None,
    ctx: RunContext | None = None,
    job: dict | None = None,
) -> LaunchPlan:
    """Everything ``launch`` will do, without doing it (pure apart from probing devices).

    Args:
        devices: The device plan, when the caller made it already (it is made once per job).
        ctx: The run context (run directory, resume, scaling, ...); the launcher flags fill in the rest.
        job: ``{"workload": name, "config": {...}}`` for a workload run by the rank entry point.
    """
    _check_target(target, module)
    host, port = parse_endpoint(cfg.rdzv_endpoint, nnodes=cfg.nnodes)
    secret_from_env(cfg.nnodes)  # several nodes without a shared secret: refused before anything is written
    devices = devices or plan_devices(cfg, facts or HostFacts.probe())
    ctx = run_context_for(cfg, devices, ctx)
    if cfg.log_dir:
        log_dir = cfg.log_dir
    elif ctx.run_dir:
        log_dir = str(Path(ctx.run_dir) / "logs")
    else:
        log_dir = tempfile.mkdtemp(prefix="multigpu_logs_")
    _private_folder(log_dir)  # before torch's DefaultLogsSpecs below makes it (0755)
    run_file = Path(ctx.run_dir or log_dir) / "run.json"
    env = dict(devices.env)
    env[envvars.STACKS_DIR] = str(Path(log_dir) / "stacks")
    env[envvars.RUN_FILE] = str(run_file.resolve())
    if job is None:  # a script: what `accelerate launch` gives it
        if cfg.mixed_precision is not None:
            env["ACCELERATE_MIXED_PRECISION"] = {"fp32": "no"}.get(cfg.mixed_precision, cfg.mixed_precision)
        if devices.device_types == ["cpu"]:
            # accelerate's Accelerator forms one job of CPU ranks only with this (its launcher's --cpu); without
            # it every rank is a single-process "DistributedType.NO" copy that trains on all the data
            env.setdefault("ACCELERATE_USE_CPU", "true")
    env[envvars.LAUNCHER_PID] = str(os.getpid())  # every worker dies with this process (PR_SET_PDEATHSIG)
    # torch's handler would open a store of its own for the workers, on every interface; the `multigpu`
    # rendezvous backend gives them one per round on the endpoint's address instead (launch/stores.py)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if cfg.nnodes == 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = loopback_interface()
        if loopback:  # gloo listens on the host name's address otherwise; one node needs no other
            env["GLOO_SOCKET_IFNAME"] = loopback
    elif cfg.nnodes > 1 and "GLOO_SOCKET_IFNAME" not in os.environ and os.environ.get("NCCL_SOCKET_IFNAME"):
        # gloo (object collectives, monitored barriers beside NCCL) must reach the other nodes the way NCCL does
        interface = gloo_interface(os.environ["NCCL_SOCKET_IFNAME"], _host_interfaces())
        if interface:
            env["GLOO_SOCKET_IFNAME"] = interface
    if is_nccl_job(devices, ctx.pg_backend):
        env.update(nccl_flight_recorder(log_dir))
    rdzv_configs: dict[str, object] = dict(cfg.rdzv_conf)
    rdzv_configs["is_host"] = hosts_store(cfg.nnodes, cfg.node_rank, cfg.rdzv_conf)
    run_id = nodes.job_run_id(cfg.run_id, cfg.nnodes)
    torch_config = TorchLaunchConfig(
        min_nodes=cfg.fewest_nodes,  # --nnodes MIN:MAX: torch's agent re-forms the group at any size in between
        max_nodes=cfg.nnodes,
        nproc_per_node=devices.nproc_per_node,
        run_id=run_id,
        rdzv_backend=stores.BACKEND,
        rdzv_endpoint=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        rdzv_configs=rdzv_configs,
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval_s,
        start_method="spawn",
        logs_specs=logs_specs(cfg, log_dir),
        log_line_prefix_template="[rank${rank}]: " if _teed(cfg) else None,
    )
    worker_args = ["-u", _worker.__file__, *(["-m"] if module else []), target, *args]
    # the user's umask: a user's script gets it back (the worker wrapper sets it); a built-in workload keeps 0077
    # for its run folder and gives it to the outputs the user names (files.user_made)
    run_data = {"workload": None, "config": None, **(job or {}), "run": ctx.to_dict(), "umask": user_umask()}
    if devices.gpu_ranks is not None:
        run_data["gpu_ranks"] = devices.gpu_ranks  # a hybrid job: the worker wrapper hides GPUs from the rest
    return LaunchPlan(torch_config, sys.executable, worker_args, env, devices, log_dir, run_file, run_data)


def stopped_by(sig: int) -> BaseException:
    """What a signal the launcher turned into torch's ``SignalException`` ends the command with: Ctrl-C's
    ``KeyboardInterrupt``, else one line naming the signal (the scheduler's warning where it was one)."""
    if sig == signal.SIGINT:
        return KeyboardInterrupt()
    warning = sig == signal.SIGTERM and processes.warned()
    return InterruptedBySignalError(sig, "the scheduler's warning (SIGUSR1, passed to the ranks as SIGTERM)"
                                    if warning else None)


def _teed(cfg: LaunchConfig) -> bool:
    """Every worker's output also written to its log file, each line prefixed by its rank: with ``--log-dir`` or
    ``--rank-prefix``, and on several nodes (a batch job's console: each node's logs then sit in the run folder)."""
    return bool(cfg.log_dir or cfg.rank_prefix or cfg.nnodes > 1)


def logs_specs(cfg: LaunchConfig, log_dir: str) -> DefaultLogsSpecs:
    """Where each worker's output goes: torchrun's ``--tee``/``--redirects``/``--local-ranks-filter``, under
    ``<log dir>/node<k>/`` (:mod:`multigpu.launch.nodelogs`).

    By default, with ``--log-dir`` (or ``--rank-prefix``, or on several nodes) every worker's output is also
    written there, each line prefixed by its rank; otherwise workers write straight to this terminal, so rank 0's
    progress bars work.
    """
    default = Std.ALL if _teed(cfg) else Std.NONE
    return nodelogs.NodeLogsSpecs(
        node_rank=cfg.node_rank,
        log_dir=log_dir,
        tee=Std.from_str(cfg.tee) if cfg.tee is not None else default,
        redirects=Std.from_str(cfg.redirects) if cfg.redirects is not None else Std.NONE,
        local_ranks_filter=set(cfg.local_ranks_filter) if cfg.local_ranks_filter else None,
    )


def independent_copies(stacks_dir: Path, local_world_size: int, nnodes: int) -> str | None:
    """One line when no rank of this node joined a process group in a job of several ranks, else None.

    The worker wrapper marks ``<stacks dir>/joined/rank<R>`` when a rank joins one (``_worker.py``).
    """
    if local_world_size * nnodes < 2 or any((stacks_dir / "joined").glob("rank*")):
        return None
    ranks = sorted(int(p.stem[4:]) for p in stacks_dir.glob("rank*.txt") if p.stem[4:].isdigit())
    if not ranks:
        return None  # no worker wrapper ran here (nothing is known)
    named = " and ".join(f"rank {r}" for r in ranks[:2]) + (f" and {len(ranks) - 2} more" if len(ranks) > 2 else "")
    where = "" if nnodes == 1 else " on this node"
    return (f"{named}{where} never joined a process group: your script ran as "
            f"{local_world_size * nnodes if nnodes == 1 else local_world_size} independent copies. Call "
            "mg.init() (or torch.distributed.init_process_group) in the script; an accelerate script on CPU "
            "ranks needs Accelerator(cpu=True) or PartialState(cpu=True); a Lightning Fabric script needs "
            "Fabric(devices=int(os.environ['LOCAL_WORLD_SIZE'])), the processes started on each node")


def _host_interfaces() -> list[tuple[str, bool]]:
    """(name, up) of this host's network interfaces, in the order the OS lists them."""
    import psutil

    stats = psutil.net_if_stats()
    return [(name, bool(stat.isup)) for name, stat in stats.items()]


def is_nccl_job(devices: DevicePlan, pg_backend: str | None) -> bool:
    """Every rank on its own GPU, so the process group is NCCL (hybrid and shared-GPU jobs use gloo)."""
    return bool(devices.gpu_ids) and not devices.hybrid and not devices.shared and pg_backend != "gloo"


def nccl_flight_recorder(log_dir: str) -> dict[str, str]:
    """NCCL's flight recorder on, dumped into the run's log directory when a collective times out.

    The user's own settings win (they are in the environment the workers inherit; only unset ones are added)."""
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": NCCL_TRACE_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",  # torch's default; the dump on timeout needs it (ProcessGroupNCCL.hpp)
        # the dump's path prefix, under both of torch's names (TORCH_FR_* is the newer)
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(Path(log_dir) / NCCL_TRACE_DIR / "rank_"),
        "TORCH_FR_DUMP_TEMP_FILE": str(Path(log_dir) / NCCL_TRACE_DIR / "rank_"),
    }
    return {k: v for k, v in wanted.items() if k not in os.environ}


def nccl_dump_prefix(env: dict[str, str]) -> str | None:
    """Where this job's NCCL flight recorder dumps go (``<prefix><rank>``): the user's setting, else the plan's."""
    for name in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        if os.environ.get(name) or env.get(name):
            return os.environ.get(name) or env[name]
    return None


_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout: WorkNCCL\(SeqNum=(?P<seq>\d+), "
                       r"OpType=(?P<op>\w+)[^)]*?Timeout\(ms\)=(?P<ms>\d+)\)")


def nccl_watchdog(exitcode: int, log_text: str, nccl: bool) -> str | None:
    """What to say when NCCL's watchdog ended a rank, else None (pure).

    On NCCL a collective that never completes (a rank skipped it, or is stuck before it) does not raise in
    Python: the host only queued it. NCCL's watchdog finds it after the process group's timeout (--timeout-s),
    logs "Watchdog caught collective operation timeout" and takes the process down with SIGABRT.
    """
    found = _WATCHDOG.search(log_text or "")
    if found:
        return (f"NCCL's watchdog aborted it: {found['op'].lstrip('_').lower()} (collective #{found['seq']}) did not "
                f"complete within {int(found['ms']) / 1000:g}s (--timeout-s). A rank probably skipped this "
                "collective or is stuck before it")
    if nccl and exitcode == -signal.SIGABRT:
        return ("killed by SIGABRT: on NCCL that is how its watchdog ends a rank whose collective did not complete "
                "within --timeout-s (a rank probably skipped a collective or is stuck before it); its log has "
                "the watchdog's line")
    return None


def _rank_log_tail(log_dir: str, local_rank: int, size: int = 65536) -> str:
    """The end of a rank's stderr.log under torch's log folder (latest attempt); "" when output was not teed."""
    logs = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"), key=lambda p: p.stat().st_mtime)
    if not logs:
        return ""
    with open(logs[-1], "rb") as fh:
        fh.seek(max(0, logs[-1].stat().st_size - size))
        return fh.read().decode(errors="replace")


def _nccl_dumps(prefix: str) -> str:
    folder, stem = Path(prefix).parent, Path(prefix).name
    dumps = sorted(folder.glob(f"{stem}*")) if folder.is_dir() else []
    if not dumps:
        return f"none written under {folder} (NCCL dumps only on a collective timeout)"
    return (f"{', '.join(p.name for p in dumps)} in {folder}; read them with "
            f"`python -m torch.distributed.flight_recorder.fr_trace {folder}`")


def _private_folder(path: str) -> None:
    """Create the log folder for this user only (0700): worker output, error files and the folder names that
    carry the run id are nobody else's to read. A folder that exists keeps the mode its owner gave it."""
    from multigpu.launch.rundir import cannot_create

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        if not os.path.isdir(path):
            raise ConfigError(f"--log-dir {path} is a file, not a folder; valid: a folder (it is created if "
                              "missing)") from None
    except OSError as exc:  # checked before (launch.flags); here only if it changed since
        raise cannot_create(Path(path), exc, "--log-dir") from None


@contextlib.contextmanager
def _private_store(nnodes: int) -> Iterator[str | None]:
    """One node: a folder only this user can open (0700) for the rendezvous store and the FileStore where
    ``mg.init()`` ranks meet, so they never use the workers' TCP store, which any local user can reach; removed
    after the job (by the reaper if the launcher is killed). Its path reaches the ranks in the run file
    (``run.json``'s ``private_store``), not in a variable."""
    if nnodes != 1:
        yield None
        return
    folder = tempfile.mkdtemp(prefix="multigpu_store_")
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


_LAUNCHED = False


def _launcher_marks(called: float) -> dict[str, float | None]:
    """The launcher's start-up marks (:mod:`multigpu.monitor.startup`): its process's start for its first launch,
    the call to :func:`launch` for later ones (``bench``, ``verify``), and now, as it hands the job to the agent."""
    global _LAUNCHED
    start = called if _LAUNCHED else _worker.process_start_time() or called
    _LAUNCHED = True
    return {"launcher_start": start, "launcher_ready": time.time()}


def _elastic_launch(config: TorchLaunchConfig, entrypoint: str, args: Sequence[str]) -> dict:
    """The one call into torch's agent (tests replace this with a mock)."""
    return elastic_launch(config, entrypoint)(*args)


@contextlib.contextmanager
def _quiet_agent_logs() -> Iterator[None]:
    """torch's agent logs every worker exit and signal; our summary says it once, readably (``--debug``: all)."""
    if os.environ.get(envvars.DEBUG) == "1":
        yield
        return
    loggers = [logging.getLogger("torch.distributed.elastic")] + [
        logger for name, logger in list(logging.root.manager.loggerDict.items())
        if name.startswith("torch.distributed.elastic.") and isinstance(logger, logging.Logger)
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


@contextlib.contextmanager
def _environment(extra: dict[str, str], drop: Sequence[str] = ()) -> Iterator[None]:
    """Workers inherit the launcher's environment: set ``extra`` and unset ``drop`` for the launch, then put it
    all back.

    The whole environment is restored, not only ``extra``: torch's agent sets variables of its own
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``), which must not leak into a caller that launches several
    jobs from one process (``multigpu bench``, ``multigpu verify``, tests).
    """
    saved = dict(os.environ)
    os.environ.update(extra)
    for name in drop:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _traceback_tail(failure) -> list[str]:
    """The worker's traceback as the user needs it: their own frames and the exception line.

    Frames of our wrapper, runpy, multigpu, torch and the standard library are left out
    (``--debug`` on the worker side, or the error file, has the whole stack).
    """
    data = failure.error_file_data or {}
    message = data.get("message")
    stack = message.get("extraInfo", {}).get("py_callstack", "") if isinstance(message, dict) else ""
    # of a chain of exceptions, the last one is what the user's code saw
    stack = re.split(r"\n(?:The above exception was the direct cause|During handling of the above)[^\n]*\n", stack)[-1]
    lines: list[str] = []
    keep_code = False
    for line in stack.rstrip().splitlines():
        frame = FRAME.match(line)
        if frame:
            keep_code = not is_library(frame["file"])
            if keep_code:
                lines.append(line)
        elif line.startswith("    "):
            if keep_code and set(line.strip()) - {"^", "~"}:
                lines.append(line)
        elif line.strip() and not line.startswith(("Traceback", "The above exception", "During handling")):
            lines.append(line)  # the exception line(s)
    return lines[-_TAIL_LINES:]


def _message(failure) -> str:
    data = failure.error_file_data or {}
    message = data.get("message")
    if isinstance(message, dict):
        return str(message.get("message", "")).strip()
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    return f"exited with code {failure.exitcode} without a Python exception"


def _root_failure(err: ChildFailedError):
    """torch's first failure, unless it is a consequence of another rank's (a collective that lost its peer, or a
    rank stopped by the agent): then a collective that timed out within the same second (also on a rank the agent
    stopped while it was still exiting after that timeout: its error file was written first), else an error of its own
    within that second (error files time failures to the second; torch's "first" of a tie is the lowest rank), else
    a rank killed by a signal other than the agent's stop. Such a rank writes no error file: torch times it when
    the agent saw it, which is later than the peer that lost it."""
    rank, failure = err.get_first_failure()
    if not restarts.is_consequence(failure, err.failures):
        return rank, failure
    when = failure.timestamp
    others = [(other, candidate) for other, candidate in sorted(err.failures.items()) if other != rank]
    near = [(other, candidate) for other, candidate in others if abs(candidate.timestamp - when) <= 1]
    for other, candidate in near:  # a rank stopped by the agent after its own timeout (still in its exit) counts
        if (candidate.exitcode > 0 or candidate.exitcode == -signal.SIGTERM) and "timed out after" in _message(candidate):
            return other, candidate
    for other, candidate in near:
        if candidate.exitcode > 0 and not restarts.is_consequence(candidate, err.failures):
            return other, candidate
    for other, candidate in others:
        if candidate.exitcode < 0 and not restarts.is_consequence(candidate, err.failures):
            return other, candidate
    return rank, failure


def summarize_failure(err: ChildFailedError, world_size: int, log_dir: str, logs_teed: bool = True,
                      nccl_dump: str | None = None, memory: MemoryWatch | None = None, *,
                      node_rank: int | None = None) -> WorkerFailedError:
    """One readable summary: which rank failed first, how, its traceback's tail, where the logs are.

    ``nccl_dump``: the NCCL flight recorder's dump prefix when the job ran on NCCL (None: not NCCL).
    ``memory`` (taken when the job started) names the OOM killer when the rank died by SIGKILL and the
    kernel counted an OOM kill meanwhile, or the cgroup's memory peaked at its limit.
    """
    rank, failure = _root_failure(err)
    text = _message(failure)
    oom = memory.explain_sigkill() if memory is not None and failure.exitcode == -signal.SIGKILL else None
    if oom is not None and text.startswith("killed by signal"):
        text = f"{text}: {oom}"
    watchdog = nccl_watchdog(failure.exitcode, _rank_log_tail(log_dir, failure.local_rank), nccl_dump is not None)
    if watchdog:
        text = watchdog
    lines = [f"rank {rank} of {world_size} failed first (exit code {failure.exitcode}): {text.splitlines()[0] if text else ''}"]
    tail = _traceback_tail(failure)
    if len(tail) == 1 and tail[0].partition(": ")[2] in text:
        tail = []  # the exception line alone says nothing the first line did not
    if tail:
        lines.append("  its traceback ends:")
        lines += [f"    {ln}" for ln in tail]
    hint = assumption_hint("\n".join([text, *tail]))
    if hint:
        lines.append(f"  hint: {hint}")
    address_space = explain_address_space("\n".join([text, *tail]))
    if address_space:
        lines.append(f"  memory: {address_space}")
    others = sorted(r for r, f in err.failures.items() if r != rank and f.exitcode > 0)
    if others:  # negative exit codes are the ranks the agent stopped after the first failure
        lines.append(f"  also failed: rank(s) {', '.join(map(str, others))}")
    positions = read_positions(Path(log_dir) / "stacks", skip={rank})
    if positions:
        lines.append("  where the other ranks stood when stopped:")
        lines += [f"    {p.describe()}" for p in positions]
    else:
        lines.append("  other ranks: stopped by the launcher")
    if watchdog and nccl_dump:
        lines.append(f"  NCCL flight recorder: {_nccl_dumps(nccl_dump)}")
    if node_rank is not None and (elsewhere := nodelogs.other_nodes_failures(log_dir, node_rank)):
        lines.append("  on other nodes (their error files in the shared run folder):")  # the cause, often
        lines += [f"    {line}" for line in elsewhere]
    where = "stdout.log / stderr.log per rank" if logs_teed else "the error file per rank; output went to the console"
    lines.append(f"  full logs: {log_dir} ({where})")
    wrote = isinstance((failure.error_file_data or {}).get("message"), dict)  # not the worker's placeholder
    error_file = failure.error_file if wrote and os.path.isfile(failure.error_file) else None
    return WorkerFailedError(
        "\n".join(lines), rank=rank, exitcode=failure.exitcode, message=text, error_file=error_file
    )


def _unreadable_error_file(log_dir: str, world_size: int) -> WorkerFailedError | None:
    """A worker failed but its error file is empty or cut short: on a full disk, say so (the file's
    place and the free space), instead of torch's JSON parser's complaint."""
    from multigpu.files import describe_os_error

    for path in sorted(Path(log_dir).glob("*/attempt_*/*/error.json")):
        try:
            json.loads(path.read_text(encoding="utf-8"))
            continue
        except (OSError, ValueError):
            pass
        free = shutil.disk_usage(path.parent).free
        full = describe_os_error(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))) if free < (1 << 20) else None
        cause = f"{full}: {format_bytes(free)} free there" if full else f"{format_bytes(free)} free there"
        local = path.parent.name
        return WorkerFailedError(
            f"local rank {local} failed, and its error file {path} could not be written ({path.stat().st_size} "
            f"bytes; {cause}), so its own message is lost\n  full logs: {log_dir}",
            rank=int(local) if local.isdigit() else -1, exitcode=1, message=cause, error_file=None)
    return None


def launch(
    cfg: LaunchConfig,
    target: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    facts: HostFacts | None = None,
    devices: DevicePlan | None = None,
    ctx: RunContext | None = None,
    job: dict | None = None,
    require_group: bool = False,
) -> LaunchPlan:
    """Run ``target`` on every worker of this node and wait. Returns the plan it ran.

    ``devices``, ``ctx`` and ``job`` as in :func:`build_plan`. A job of several ranks none of which joined
    a process group ran as independent copies of the script: one line says so at the end, and with
    ``require_group`` (``bench``, ``verify``: their figures would be meaningless) it is an error.

    On several nodes the launchers meet first (:func:`multigpu.launch.nodes.joined`): a node that fails before
    the job forms makes every other node stop within seconds, naming it.

    Raises:
        WorkerFailedError: a worker failed (after any restarts); the message is the summary.
        RendezvousTimeoutError: the other nodes did not join in time.
        NodeFailedError: another node stopped before the job formed.
    """
    with nodes.joined(cfg) as session:
        return _launch(nodes.placed(cfg, session), target, args, module=module, facts=facts, devices=devices,
                       ctx=ctx, job=job, require_group=require_group)


def _start_beats(cfg: LaunchConfig, plan: LaunchPlan):
    """On several nodes: this node's heartbeat, and the watch on the others' (:meth:`nodes.Nodes.start_beats`).
    A node found lost is named at once; this node's ranks are stopped then, since on NCCL they would wait for
    the lost ranks for the whole collective timeout: torch's agent then ends the job, or, in an elastic job
    (``--nnodes MIN:MAX``), re-forms it with the nodes left. Returns the session (None on one node)."""
    session = nodes.open_session(plan.torch_config.run_id) if cfg.nnodes != 1 else None
    if session is None:
        return None

    def on_lost(node: int) -> None:
        if cfg.elastic and not nodes.store_gone(session):  # else the job's error line names it, once ranks stopped
            print(f"multigpu: {nodes.lost_line(session, node)}; the job goes on with the nodes left (--nnodes "
                  f"{cfg.fewest_nodes}:{cfg.nnodes})", file=sys.stderr, flush=True)
        processes.stop_workers()

    steps = _steps_folder(plan)
    os.makedirs(steps, mode=0o700, exist_ok=True)
    session.start_beats(steps, on_lost)
    return session


def _steps_folder(plan: LaunchPlan) -> str:
    """Where this node's ranks count the steps they finished (:mod:`multigpu.runtime.progress`)."""
    from multigpu.runtime import progress

    return progress.folder(plan.env[envvars.STACKS_DIR], plan.env[envvars.LAUNCHER_PID])


def _store_lost(cfg: LaunchConfig, session) -> None:
    """Raise the one line that ends a job whose rendezvous store is gone (node 0's launcher, where torch's c10d
    store lives, was lost): no job goes on without it, an elastic one neither."""
    if session is not None and nodes.store_gone(session):
        raise NodeLostError(nodes.store_lost_line(session, hosted_by_node0="is_host" not in cfg.rdzv_conf))


def _lost_node(session, err: ChildFailedError) -> str | None:
    """The line naming a node found lost, when the ranks failed because of it, else None. A rank that lost its
    peer (or was stopped) fails within a second of a node's death; the node is known as lost only when its
    heartbeat's deadline passed: wait for that, but not for a failure of this node's own making."""
    if not session.lost:
        _, failure = _root_failure(err)
        if failure.exitcode > 0 and not restarts.is_consequence(failure, err.failures):
            return None
        session.wait_lost(session.beat_deadline_s + 2 * nodes.BEAT_S)
    return nodes.lost_line(session, min(session.lost)) if session.lost else None


def _tampered(session, refused: Exception) -> LaunchError:
    """The line that ends a job whose rendezvous state someone else wrote (:data:`stores.TAMPERED`). The node
    hosting the store keeps it open until the others ended: each reads the same state and says the same line,
    where it would otherwise find the store gone with this node and blame "node 0 was lost"."""
    if session is not None:
        session.linger_until_ended("stopped: the rendezvous state was tampered with")
    return LaunchError(f"the job was stopped: {refused}")


def _held(cfg: LaunchConfig):
    """``--log-dir``, where a plain job writes its run.json, locked for the job as a run folder is: a second job on
    it while this one runs is one line naming this one (:mod:`multigpu.launch.rundir`)."""
    from multigpu.launch import rundir

    return rundir.hold(cfg.log_dir, node_rank=cfg.node_rank, flag="--log-dir")


def _launch(cfg: LaunchConfig, target: str, args: Sequence[str], *, module: bool, facts: HostFacts | None,
            devices: DevicePlan | None, ctx: RunContext | None, job: dict | None, require_group: bool) -> LaunchPlan:
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousStateError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError as TorchRdzvTimeout

    started = time.time()
    own_logs = bool(cfg.log_dir) and not (ctx is not None and ctx.run_dir)  # the job's run.json goes there
    if own_logs:
        from multigpu.launch import rundir

        rundir.refuse_run_folder(cfg.log_dir)  # a workload run's folder: its run.json would be replaced
    plan = build_plan(cfg, target, args, module=module, facts=facts, devices=devices, ctx=ctx, job=job)
    world_size = plan.devices.nproc_per_node * cfg.nnodes
    dump = nccl_dump_prefix(plan.env) if is_nccl_job(plan.devices, plan.run_data["run"].get("pg_backend")) else None
    if dump:
        Path(dump).parent.mkdir(parents=True, exist_ok=True)  # NCCL writes the files, not the folder
    # the secret that signs the rendezvous state is handed to the handler in memory; no worker inherits it
    secret = secret_from_env(cfg.nnodes) or secrets.token_bytes(32)
    memory = MemoryWatch()  # OOM kills counted so far: a SIGKILLed rank is then named as the OOM killer's
    stopped: list[int] = []
    session = None
    try:
        with _held(cfg) if own_logs else contextlib.nullcontext(), \
                _private_store(cfg.nnodes) as private, _quiet_agent_logs(), quiet.filtered_tails(), \
                _environment(plan.env, drop=(envvars.RDZV_SECRET,)), forkserver.serving(), \
                processes.job_processes(remove_on_death=[private] if private else []) as stopped:
            write_json_atomic(plan.run_file, {**plan.run_data, **({"private_store": private} if private else {}),
                                              "startup": _launcher_marks(started)})
            if plan.devices.note:  # after the run file: a disk too full for it is the only line
                print(f"multigpu: {plan.devices.note}", file=sys.stderr)
            stores.register(plan.torch_config.run_id, secret, private)
            recorded = plan.run_data["run"].get("run_dir") or cfg.log_dir
            session = _start_beats(cfg, plan)
            try:
                with restarts.reporting(recorded) if cfg.max_restarts else contextlib.nullcontext():
                    _elastic_launch(plan.torch_config, plan.entrypoint, plan.args)
            except ChildFailedError as exc:
                # a planted rendezvous state that another node refused first: that is why the workers failed
                if cfg.nnodes != 1 and (refused := stores.tampered(plan.torch_config.run_id)) is not None:
                    raise _tampered(session, refused) from None
                if cfg.nnodes != 1 and (other := nodes.posted_failure(plan.torch_config.run_id)) is not None:
                    raise NodeFailedError(other) from None
                _store_lost(cfg, session)
                if session is not None and (lost := _lost_node(session, exc)) is not None:
                    raise NodeLostError(lost) from None
                raise summarize_failure(exc, world_size, plan.log_dir, _teed(cfg), dump, memory,
                                        node_rank=cfg.node_rank if cfg.nnodes > 1 else None) from None
            except SignalException as exc:  # the agent has stopped the workers it knew of; job_processes the rest
                if session is not None and processes.warned():  # every node stops at the warning: end together
                    session.stop_together()
                raise stopped_by(exc.sigval) from None
            except TorchRdzvTimeout as exc:
                _store_lost(cfg, session)
                reason = f": {exc}" if str(exc).strip() else ""
                raise RendezvousTimeoutError(
                    f"rendezvous at {cfg.rdzv_endpoint} timed out waiting for {cfg.nnodes} node(s){reason}. "
                    "Start every node with the same --rdzv-endpoint and --nnodes."
                ) from None
            except MultigpuError:
                raise
            except RendezvousStateError as exc:
                _store_lost(cfg, session)
                if stores.TAMPERED not in str(exc):
                    raise LaunchError(f"the launcher could not start the job: {exc}") from None
                raise _tampered(session, exc) from None
            except json.JSONDecodeError as exc:  # torch's agent could not parse a failed worker's error file
                raise _unreadable_error_file(plan.log_dir, world_size) or LaunchError(
                    f"the launcher could not start the job: {exc}") from None
            except (RuntimeError, ValueError, RendezvousError) as exc:
                # another node stopped before the job formed and closed the rendezvous: name it
                if cfg.nnodes != 1 and (other := nodes.posted_failure(plan.torch_config.run_id)) is not None:
                    raise NodeFailedError(other) from None
                _store_lost(cfg, session)
                raise LaunchError(f"the launcher could not start the job: {exc}") from None
    finally:  # also after a failure or a signal: the error line stays the last one
        if session is not None:
            session.stop_beats("ended")
            shutil.rmtree(_steps_folder(plan), ignore_errors=True)
        if stopped:
            print(f"multigpu: stopped {len(stopped)} process(es) that the workers had left running", file=sys.stderr)
    copies = independent_copies(Path(plan.log_dir) / "stacks", plan.devices.nproc_per_node, cfg.nnodes)
    if copies and require_group:
        raise LaunchError(copies)
    if copies:
        print(f"multigpu: warning: {copies}", file=sys.stderr)
    if cfg.log_dir is None and not plan.run_data["run"].get("run_dir"):  # build_plan's mkdtemp: kept only on failure
        shutil.rmtree(plan.log_dir, ignore_errors=True)
    return plan

