"""Start the job through torchrun's elastic agent and summarise failures (runs in the launcher).

``launch(cfg, target, args, run=..., job=...)`` resolves devices
(``devices.plan_devices``, unless the caller already did), writes the run file
(``run.json``: the workload and its config, if any, and the run context the
ranks read through :mod:`multigpu.runtime.context`), builds torch's
``LaunchConfig`` (c10d rendezvous; ``localhost:0`` on one node) and calls
``elastic_launch`` through :func:`_elastic_launch`, the one seam tests replace
with a mock. Nothing here spawns, rendezvous or restarts by itself: torch's
agent does all three, with the rendezvous backend of :mod:`multigpu.launch.stores`
(torch's c10d handler on stores that listen on the endpoint's address, not on
every interface). :mod:`multigpu.launch.processes` sees that no process of the
job outlives the launch and that a signal ends it the same way at any moment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig
from torch.distributed.launcher.api import elastic_launch

from multigpu.errors import (
    ConfigError,
    InterruptedBySignalError,
    LaunchError,
    MultigpuError,
    RendezvousTimeoutError,
    WorkerFailedError,
)
from multigpu.launch import _worker, processes, stores
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import DevicePlan, HostFacts, format_bytes, plan_devices
from multigpu.launch.memlimit import MemoryWatch
from multigpu.launch.rendezvous import hosts_store, loopback_interface, parse_endpoint
from multigpu.launch.stacks import FRAME, is_library, read_positions
from multigpu.runtime.context import RUN_FILE_VAR, RunContext

__all__ = ["LaunchPlan", "build_plan", "launch", "summarize_failure"]

_TAIL_LINES = 6


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



def run_context_for(cfg: LaunchConfig, devices: DevicePlan, run: RunContext | None = None) -> RunContext:
    """The command's run context completed with what the launcher flags and the device plan decided."""
    run = run or RunContext()
    return dataclasses.replace(
        run, timeout_s=cfg.timeout_s, stall_timeout_s=cfg.stall_timeout_s, profile=cfg.profile or run.profile,
        profile_steps=cfg.profile_steps, sample_interval_s=cfg.sample_interval_s,
        isolated=devices.isolated, allow_cpu_ranks=cfg.allow_cpu_ranks, hybrid=devices.hybrid,
        pg_backend="gloo" if devices.shared else run.pg_backend,
    )


def build_plan(
    cfg: LaunchConfig,
    target: str,
    args: Sequence[str] = (),
    *,
    module: bool = False,
    facts: HostFacts | None = None,
    devices: DevicePlan | None = None,
    run: RunContext | None = None,
    job: dict | None = None,
) -> LaunchPlan:
    """Everything ``launch`` will do, without doing it (pure apart from probing devices).

    Args:
        devices: The device plan, when the caller made it already (it is made once per job).
        run: The run context (run directory, resume, scaling, ...); the launcher flags fill in the rest.
        job: ``{"workload": name, "config": {...}}`` for a workload run by the rank entry point.
    """
    _check_target(target, module)
    host, port = parse_endpoint(cfg.rdzv_endpoint, nnodes=cfg.nnodes)
    devices = devices or plan_devices(cfg, facts or HostFacts.probe())
    run = run_context_for(cfg, devices, run)
    if cfg.log_dir:
        log_dir = cfg.log_dir
    elif run.run_dir:
        log_dir = str(Path(run.run_dir) / "logs")
    else:
        log_dir = tempfile.mkdtemp(prefix="multigpu_logs_")
    run_file = Path(run.run_dir or log_dir) / "run.json"
    env = dict(devices.env)
    env["MULTIGPU_STACKS_DIR"] = str(Path(log_dir) / "stacks")
    env[RUN_FILE_VAR] = str(run_file.resolve())
    if cfg.mixed_precision is not None and job is None:  # a script: what `accelerate launch` gives it
        env["ACCELERATE_MIXED_PRECISION"] = {"fp32": "no"}.get(cfg.mixed_precision, cfg.mixed_precision)
    env[_worker.LAUNCHER_PID_VAR] = str(os.getpid())  # every worker dies with this process (PR_SET_PDEATHSIG)
    # torch's handler would open a store of its own for the workers, on every interface; the `multigpu`
    # rendezvous backend gives them one per round on the endpoint's address instead (launch/stores.py)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    if cfg.nnodes == 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = loopback_interface()
        if loopback:  # gloo listens on the host name's address otherwise; one node needs no other
            env["GLOO_SOCKET_IFNAME"] = loopback
    rdzv_configs: dict[str, object] = dict(cfg.rdzv_conf)
    rdzv_configs["is_host"] = hosts_store(cfg.nnodes, cfg.node_rank, cfg.rdzv_conf)
    run_id = cfg.run_id or ("multigpu" if cfg.nnodes > 1 else uuid.uuid4().hex[:12])
    torch_config = TorchLaunchConfig(
        min_nodes=cfg.nnodes,
        max_nodes=cfg.nnodes,
        nproc_per_node=devices.nproc_per_node,
        run_id=run_id,
        rdzv_backend=stores.BACKEND,
        rdzv_endpoint=f"[{host}]:{port}" if ":" in host else f"{host}:{port}",
        rdzv_configs=rdzv_configs,
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval_s,
        start_method="spawn",
        # With --log-dir, every worker's output is also written there, prefixed by rank.
        # Without it, workers write straight to this terminal, so rank 0's progress bars work.
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL if cfg.log_dir else Std.NONE),
        log_line_prefix_template="[rank${rank}]: " if cfg.log_dir else None,
    )
    worker_args = ["-u", _worker.__file__, *(["-m"] if module else []), target, *args]
    run_data = {"workload": None, "config": None, **(job or {}), "run": run.to_dict()}
    return LaunchPlan(torch_config, sys.executable, worker_args, env, devices, log_dir, run_file, run_data)


def _elastic_launch(config: TorchLaunchConfig, entrypoint: str, args: Sequence[str]) -> dict:
    """The one call into torch's agent (tests replace this with a mock)."""
    return elastic_launch(config, entrypoint)(*args)


@contextlib.contextmanager
def _quiet_agent_logs() -> Iterator[None]:
    """torch's agent logs every worker exit and signal; our summary says it once, readably (``--debug``: all)."""
    if os.environ.get("MULTIGPU_DEBUG") == "1":
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
def _environment(extra: dict[str, str]) -> Iterator[None]:
    """Workers inherit the launcher's environment: set ``extra`` for the launch, then put it all back.

    The whole environment is restored, not only ``extra``: torch's agent sets variables of its own
    (``TORCHELASTIC_SIGNALS_TO_HANDLE``), which must not leak into a caller that launches several
    jobs from one process (``multigpu bench``, ``multigpu verify``, tests).
    """
    saved = dict(os.environ)
    os.environ.update(extra)
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


def summarize_failure(err: ChildFailedError, world_size: int, log_dir: str, logs_teed: bool = True,
                      memory: MemoryWatch | None = None) -> WorkerFailedError:
    """One readable summary: which rank failed first, how, its traceback's tail, where the logs are.

    ``memory`` (taken when the job started) names the OOM killer when the rank died by SIGKILL and the
    kernel counted an OOM kill meanwhile, or the cgroup's memory peaked at its limit.
    """
    rank, failure = err.get_first_failure()
    text = _message(failure)
    oom = memory.explain_sigkill() if memory is not None and failure.exitcode == -signal.SIGKILL else None
    if oom is not None and text.startswith("killed by signal"):
        text = f"{text}: {oom}"
    lines = [f"rank {rank} of {world_size} failed first (exit code {failure.exitcode}): {text.splitlines()[0] if text else ''}"]
    tail = _traceback_tail(failure)
    if len(tail) == 1 and tail[0].partition(": ")[2] in text:
        tail = []  # the exception line alone says nothing the first line did not
    if tail:
        lines.append("  its traceback ends:")
        lines += [f"    {ln}" for ln in tail]
    others = sorted(r for r, f in err.failures.items() if r != rank and f.exitcode > 0)
    if others:  # negative exit codes are the ranks the agent stopped after the first failure
        lines.append(f"  also failed: rank(s) {', '.join(map(str, others))}")
    positions = read_positions(Path(log_dir) / "stacks", skip={rank})
    if positions:
        lines.append("  where the other ranks stood when stopped:")
        lines += [f"    {p.describe()}" for p in positions]
    else:
        lines.append("  other ranks: stopped by the launcher")
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
    run: RunContext | None = None,
    job: dict | None = None,
) -> LaunchPlan:
    """Run ``target`` on every worker of this node and wait. Returns the plan it ran.

    ``devices``, ``run`` and ``job`` as in :func:`build_plan`.

    Raises:
        WorkerFailedError: a worker failed (after any restarts); the message is the summary.
        RendezvousTimeoutError: the other nodes did not join in time.
    """
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError as TorchRdzvTimeout

    plan = build_plan(cfg, target, args, module=module, facts=facts, devices=devices, run=run, job=job)
    from multigpu.files import write_json_atomic

    write_json_atomic(plan.run_file, plan.run_data)
    if plan.devices.note:
        print(f"multigpu: {plan.devices.note}", file=sys.stderr)
    world_size = plan.devices.nproc_per_node * cfg.nnodes
    stores.register()
    memory = MemoryWatch()  # OOM kills counted so far: a SIGKILLed rank is then named as the OOM killer's
    with _quiet_agent_logs(), _environment(plan.env), processes.job_processes() as stopped:
        try:
            _elastic_launch(plan.torch_config, plan.entrypoint, plan.args)
        except ChildFailedError as exc:
            raise summarize_failure(exc, world_size, plan.log_dir, cfg.log_dir is not None, memory) from None
        except SignalException as exc:  # the agent has stopped the workers it knew of; job_processes the rest
            if exc.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None
            raise InterruptedBySignalError(exc.sigval) from None
        except TorchRdzvTimeout as exc:
            reason = f": {exc}" if str(exc).strip() else ""
            raise RendezvousTimeoutError(
                f"rendezvous at {cfg.rdzv_endpoint} timed out waiting for {cfg.nnodes} node(s){reason}. "
                "Start every node with the same --rdzv-endpoint and --nnodes."
            ) from None
        except MultigpuError:
            raise
        except json.JSONDecodeError as exc:  # torch's agent could not parse a failed worker's error file
            raise _unreadable_error_file(plan.log_dir, world_size) or LaunchError(
                f"the launcher could not start the job: {exc}") from None
        except (RuntimeError, ValueError, RendezvousError) as exc:
            raise LaunchError(f"the launcher could not start the job: {exc}") from None
    if stopped:
        print(f"multigpu: stopped {len(stopped)} process(es) that the workers had left running", file=sys.stderr)
    if cfg.log_dir is None and not plan.run_data["run"].get("run_dir"):  # build_plan's mkdtemp: kept only on failure
        shutil.rmtree(plan.log_dir, ignore_errors=True)
    return plan

