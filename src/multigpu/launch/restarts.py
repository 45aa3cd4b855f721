"""Which rank died and that the worker group restarts, said when it happens (runs in the launcher).

torch's agent restarts the worker group when a worker exits with an error and ``--max-restarts`` allows it,
logging only "Worker group FAILED. 1/1 attempts left; will restart worker group" (which our quiet logs hide).
:class:`ReportingAgent` is torch's own agent, with one addition at that moment: every rank that died is named
(rank, local rank, node, host, exit code or signal, its error's first line) in one line on stderr each, and
recorded in the run folder (:data:`multigpu.runtime.context.RESTARTS_FILE`, one JSON line per death, one file
per node) for the run's ``summary.json``. Nothing else about the agent changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from multigpu.runtime.calls import lost_peer

__all__ = ["CONSEQUENCES", "ReportingAgent", "causes", "describe", "is_consequence", "reporting"]

_where: dict[str, Path | None] = {"folder": None}  # where this launch records deaths (None: stderr only)


CONSEQUENCES = ("lost a peer", "That rank probably exited or crashed")
"""What a collective says when another rank left under it (:mod:`multigpu.runtime.collectives`): a consequence."""


def is_consequence(failure, group: dict | None = None) -> bool:
    """Whether ``failure`` is a rank that failed because another left: a collective that lost its peer (ours, or
    torch's own such as DDP's all-reduce, whose error is gloo's "Connection reset by peer"), the
    SIGTERM with which torch's agent stops the rest of a group once one worker died, or (given its ``group``'s
    failures) a plain exit code with nothing said (no error file) beside a peer killed by a signal: a rank whose
    peer vanished under a collective can exit before it writes why, and a signal death is the better name."""
    if failure.exitcode == -signal.SIGTERM:  # its error file, if any, says what the stop interrupted
        return True
    said = describe(failure)
    if any(words in said for words in CONSEQUENCES) or lost_peer(said):
        return True
    return (group is not None and failure.exitcode > 0 and _said(failure) is None
            and any(_killed(other) for other in group.values()))


def _killed(failure) -> bool:
    """Killed by a signal other than the agent's own stop (SIGTERM)."""
    return failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM


def _said(failure) -> str | None:
    """The first line of the error its worker wrote, None when it wrote none."""
    message = (failure.error_file_data or {}).get("message")
    if isinstance(message, dict) and str(message.get("message", "")).strip():
        return str(message["message"]).strip().splitlines()[0]
    return None


def causes(failures: dict) -> dict:
    """The failures of one group that are not consequences of another's (by rank); all of them when every one
    looks like a consequence (nothing better to name). The one rule :func:`multigpu.launch.agent._root_failure`
    follows for the line it prints."""
    return {rank: f for rank, f in failures.items() if not is_consequence(f, failures)} or dict(failures)


def describe(failure) -> str:
    """How a worker ended: its exception's first line, else the signal, else the exit code."""
    said = _said(failure)
    if said is not None:
        return said
    if failure.exitcode < 0:
        return f"killed by signal {failure.signal_name()}"
    return f"exited with code {failure.exitcode}"


class ReportingAgent(LocalElasticAgent):
    """torch's ``LocalElasticAgent``, naming every rank that died before the group is restarted."""

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and self._remaining_restarts > 0:
            spec = worker_group.spec
            restart = spec.max_restarts - self._remaining_restarts + 1  # torch restarts next, using one
            _report(result, worker_group, restart, spec.max_restarts)
        return result


def _cause_elsewhere(group: WorkerGroup, failures: dict) -> dict[int, tuple[str, str]] | None:
    """On a job of several nodes whose ranks here all failed as consequences (they lost their peers): the other
    nodes that caused it, each in short and its line (found lost, or started again), waiting for the heartbeat's
    verdict (:meth:`multigpu.launch.nodes.Nodes.verdict`). {}: none of them (the cause is a rank of another node's own).
    None: one node, or a rank here failed of its own."""
    from multigpu.launch import nodes

    if any(not is_consequence(f, failures) for f in failures.values()):
        return None
    try:
        session = nodes.open_session(group.spec.rdzv_handler.get_run_id())
    except Exception:  # noqa: BLE001 - no handler to ask: nothing is known of other nodes
        return None
    if session is None:
        return None
    return session.verdict(time.monotonic(), session.beat_deadline_s + 2 * nodes.BEAT_S)


def _report(result: RunResult, group: WorkerGroup, restart: int, most: int) -> None:
    host = socket.gethostname()
    records = []
    elsewhere = _cause_elsewhere(group, result.failures)
    if elsewhere is not None:  # this node's ranks lost their peers: the cause is another node
        for node, (_, line) in elsewhere.items():
            records.append({"restart": restart, "node": node, "cause": line,
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        # the cause in short (a lost node's whole line was said when it was found): "node 1 (gpu7), lost"
        why = ("the cause: " + "; ".join(short for short, _ in elsewhere.values()) if elsewhere else
               "this node's ranks lost their peers on another node, whose own output says why")
        print(f"multigpu: restarting the worker group ({why}; restart {restart} of {most})", file=sys.stderr,
              flush=True)
        _record(group, records)
        return
    # torch stops the rest of the group with SIGTERM once one worker died, and lists them as failed too; a rank
    # whose collective lost its peer (the one that died) may fail on its own just before: both are the group
    # going down, not deaths, unless nothing else failed
    died = causes(result.failures)
    for rank, failure in sorted(died.items()):
        record = {"restart": restart, "rank": rank, "local_rank": failure.local_rank, "node": group.group_rank,
                  "host": host, "exitcode": failure.exitcode,
                  "signal": failure.signal_name() if failure.exitcode < 0 else None,
                  "reason": describe(failure), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        records.append(record)
        print(f"multigpu: rank {rank} (local rank {failure.local_rank} on node {group.group_rank}, {host}) died "
              f"(exit code {failure.exitcode}): {record['reason']}; restarting the worker group (restart "
              f"{restart} of {most})", file=sys.stderr, flush=True)
    _record(group, records)


def _record(group: WorkerGroup, records: list[dict]) -> None:
    folder = _where["folder"]
    if folder is not None and records:
        from multigpu.runtime.context import RESTARTS_FILE

        with contextlib.suppress(OSError):  # the line above said it; a full disk must not stop the restart
            path = folder / RESTARTS_FILE.format(node=group.group_rank)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            with os.fdopen(fd, "a", encoding="utf-8") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in records)


@contextlib.contextmanager
def reporting(folder: str | Path | None) -> Iterator[None]:
    """torch's launcher makes a :class:`ReportingAgent` for the ``with`` block; deaths are recorded in ``folder``
    (the run folder; None: said on stderr only)."""
    import torch.distributed.launcher.api as torch_launcher

    saved, saved_folder = torch_launcher.LocalElasticAgent, _where["folder"]
    torch_launcher.LocalElasticAgent = ReportingAgent  # the name launch_agent builds its agent from
    _where["folder"] = Path(folder) if folder else None
    try:
        yield
    finally:
        torch_launcher.LocalElasticAgent = saved
        _where["folder"] = saved_folder
