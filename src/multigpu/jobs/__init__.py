"""The job contract: every workload is a config class, ``check(cfg, plan)`` and ``main(cfg, ctx)``.

    from multigpu.jobs import Workload

    WORKLOAD = Workload(name="count", config=CountConfig, check=check, main=main)
    # multigpu run mypkg.count:WORKLOAD n=1000 --nproc-per-node 2

See :mod:`multigpu.jobs.workload` (the contract), :mod:`multigpu.jobs.command`
(command line -> checked job -> ``run.json`` -> launch) and
:mod:`multigpu.jobs.rank` (the rank entry point).
"""

from multigpu.jobs.registry import BUILTIN, get_workload
from multigpu.jobs.workload import Flag, JobPlan, Workload
from multigpu.runtime.context import RunContext

__all__ = ["BUILTIN", "Flag", "JobPlan", "RunContext", "Workload", "get_workload"]
