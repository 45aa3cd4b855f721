"""The one rank entry point of every workload (inside each rank).

    python -m multigpu.jobs.rank          # started by the launcher; reads $MULTIGPU_RUN_FILE

Reads ``run.json`` (workload, resolved config, run context), joins the job
with ``mg.init``, decides once which checkpoint this attempt starts from
(``ctx.resume_from``: ``--resume auto``/PATH, or the run's newest valid
checkpoint when torchrun's agent restarted the worker group; see
:mod:`multigpu.checkpoint.resume`; a workload that keeps progress of its own,
``Workload.own_progress``, decides in ``main``), calls the workload's
``main(cfg, ctx)`` and leaves with ``mg.shutdown``. Its exit code is ``main``'s.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import multigpu as mg
from multigpu.config import from_dict
from multigpu.errors import ConfigError
from multigpu.files import set_user_umask
from multigpu.jobs.registry import get_workload
from multigpu.runtime import context


def main(argv: list[str] | None = None) -> int:
    path = (argv or [None])[0] or os.environ.get(context.RUN_FILE_VAR)
    if not path:
        raise ConfigError(f"no run file: this module is started by `multigpu <workload>` (it sets {context.RUN_FILE_VAR})")
    data = context.read_run_file(path)
    if not data.get("workload"):
        raise ConfigError(f"run file '{path}' names no workload")
    workload = get_workload(data["workload"])
    cfg = from_dict(workload.config, data.get("config") or {}, prefix=workload.prefix)
    saved = data.get("config")
    ctx = dataclasses.replace(context.RunContext.from_dict(data.get("run", {})),
                              config=saved if isinstance(saved, dict) else None)  # recorded in every checkpoint
    if isinstance(data.get("umask"), int):
        set_user_umask(data["umask"])  # for the outputs the user names; the run folder stays 0700 / 0600
    context.set_current(ctx)
    mg.init(**(workload.init(cfg) if workload.init else {}))
    try:
        # decided here, once, by the rule plain scripts use too: a workload loads resume_from
        if workload.resumable and workload.own_progress is None:
            from multigpu.checkpoint.resume import decide

            ctx = decide(ctx)
            context.set_current(ctx)
        code = workload.main(cfg, ctx)
    except BaseException:
        mg.shutdown(barrier=False)  # the failure is reported by the launcher; no rank waits on this one
        raise
    mg.shutdown()
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
