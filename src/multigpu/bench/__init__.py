"""``multigpu bench``: run a workload at several world sizes and say what more ranks gained (in the launcher).

    multigpu bench --nproc 1,2,4 train.py          # strong scaling: the global problem stays fixed
    multigpu bench --nproc 1,2 --weak --repeat 3 examples/allreduce_dp.py
    multigpu bench --nproc 1,2 sim agents=4000000      # a workload, through the job contract

Pieces: :mod:`~multigpu.bench.config` (BenchConfig), :mod:`~multigpu.bench.workloads`
(what to run: script, module or workload), :mod:`~multigpu.bench.runner` (runs and bench.json),
:mod:`~multigpu.bench.table` (rows and verdicts, pure).
"""

from multigpu.bench.config import BenchConfig, parse_nproc
from multigpu.bench.runner import Launcher, run_bench, write_bench
from multigpu.bench.table import explain, scaling_rows
from multigpu.bench.workloads import Target, resolve_target

__all__ = ["BenchConfig", "Launcher", "Target", "explain", "parse_nproc", "resolve_target",
           "run_bench", "scaling_rows", "write_bench"]
