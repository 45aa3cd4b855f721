"""Every node's worker logs under the one run folder, and the failures of the other nodes (runs in the launcher).

torch's ``DefaultLogsSpecs`` puts a launcher's worker logs in ``<log dir>/<run id>_<random>/attempt_<n>/<local
rank>/``: on several nodes sharing one run folder, each node's folder is a random name and says neither the node
nor the ranks. :class:`NodeLogsSpecs` keeps torch's files and layout under ``<log dir>/node<k>/start<i>/`` instead, and
names each rank's files by its global rank beside them (hard links to torch's files)::

    <run>/logs/node0/start0/attempt_0/0/{stdout.log,stderr.log,error.json}  torch's files, as torch writes them
    <run>/logs/node0/rank0.log, rank0.stderr.log = start0/attempt_0/0/...   the latest's, by global rank
    <run>/logs/node1/rank1.log ...

``start<i>`` counts the launcher's starts on that node (a requeued job's next start is ``start1``: the logs of the
one before stay), ``attempt_<n>`` torch's restarts of the worker group within one start.

The files hold what a rank wrote when its output is teed (``--log-dir``, ``--tee``, ``--rank-prefix``, and every
multi-node job, whose console is a batch log anyway); ``error.json`` is always written.

:func:`other_nodes_failures` reads the error files the other nodes' ranks left in the shared folder, so the
failure summary of one node names a rank that failed on another (before, node 0 said only that its own rank had
lost a peer).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, LogsDest

__all__ = ["NodeLogsSpecs", "other_nodes_failures"]

_RANKS = "ranks.json"
"""In each attempt's folder: local rank -> global rank, as the agent assigned them."""


class NodeLogsSpecs(DefaultLogsSpecs):
    """torch's log files under ``<log dir>/node<node_rank>/start<i>/``, and ``rank<R>.log`` links by global rank."""

    def __init__(self, log_dir: str, node_rank: int, **kwargs):
        super().__init__(log_dir=log_dir, **kwargs)
        self.node_rank = node_rank

    def _make_log_dir(self, log_dir: str | None, rdzv_run_id: str) -> str:
        """``node<k>/start<i>``: one folder per start of the launcher (a requeued or resumed job's next start adds
        one, and keeps the logs of the start before it)."""
        node = Path(str(log_dir)) / f"node{self.node_rank}"
        node.mkdir(parents=True, exist_ok=True)
        folder = node / f"start{_latest(node, 'start') + 1}"
        folder.mkdir()
        return str(folder)

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        dest = super().reify(envs)
        if self._run_log_dir is None or not envs:
            return dest
        start = Path(self._run_log_dir)
        node = start.parent
        attempt = f"attempt_{envs[0].get('TORCHELASTIC_RESTART_COUNT', '0')}"
        ranks = {str(local): env.get("RANK", str(local)) for local, env in envs.items()}
        (start / attempt / _RANKS).write_text(json.dumps(ranks))
        for local, rank in ranks.items():
            for name, path in ((f"rank{rank}.log", dest.stdouts.get(int(local))),
                               (f"rank{rank}.stderr.log", dest.stderrs.get(int(local)))):
                link = node / name
                with contextlib.suppress(FileNotFoundError):
                    link.unlink()
                if path and os.path.isabs(path) and path != os.devnull:
                    # made now (private) and hard-linked: torch opens it for writing later, on the same inode
                    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
                    os.link(path, link)
        return dest


def _latest(folder: Path, prefix: str, sep: str = "") -> int:
    """The highest ``<prefix><sep><i>`` under ``folder`` (-1: none)."""
    found = [int(m[1]) for p in folder.glob(f"{prefix}{sep}*") if (m := re.fullmatch(rf"{prefix}{sep}(\d+)", p.name))]
    return max(found, default=-1)


def _error(path: Path) -> tuple[str, float] | None:
    """A worker's error file: its message's first line and the time of the failure (None: none written)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if not isinstance(message, dict):
        return None
    text = str(message.get("message", "")).strip().splitlines()
    stamp = message.get("extraInfo", {}).get("timestamp")
    try:
        when = float(stamp)
    except (TypeError, ValueError):
        when = path.stat().st_mtime
    return (text[0] if text else "failed"), when


def other_nodes_failures(log_dir: str | os.PathLike, node_rank: int) -> list[str]:
    """One line per rank of another node that failed (its latest attempt's error file), earliest first:
    ``node 1: rank 3 failed at 12:04:31: RuntimeError: ... (<its error file>)``. Empty when the log folder
    is not shared or no other node's rank failed."""
    found = []
    for node in sorted(Path(log_dir).glob("node*")):
        match = re.fullmatch(r"node(\d+)", node.name)
        if not match or int(match[1]) == node_rank:
            continue
        start = node / f"start{_latest(node, 'start')}"  # this job's start: the latest on every node
        attempt = start / f"attempt_{_latest(start, 'attempt', '_')}"
        if not attempt.is_dir():
            continue
        ranks: dict[str, str] = {}
        with contextlib.suppress(OSError, ValueError):
            ranks = json.loads((attempt / _RANKS).read_text())
        for path in sorted(attempt.glob("*/error.json")):
            error = _error(path)
            if error is None:
                continue
            local = path.parent.name
            rank = ranks.get(local)
            who = f"rank {rank}" if rank is not None else f"local rank {local}"
            at = datetime.datetime.fromtimestamp(error[1]).strftime("%H:%M:%S")
            found.append((error[1], f"node {match[1]}: {who} failed at {at}: {error[0]} ({path})"))
    return [line for _, line in sorted(found)]
