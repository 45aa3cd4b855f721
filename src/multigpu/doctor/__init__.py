"""``multigpu doctor``: what is wrong with this machine's setup for multi-GPU jobs (runs in the launcher).

    facts = gather_facts()            # read once from the machine (plus a short all-reduce test)
    for result in run_checks(facts):  # pure: tests pass made-up Facts
        print(result.status, result.name, result.detail, result.hint)
"""

from multigpu.doctor.checks import CHECKS, CheckResult, run_checks
from multigpu.doctor.facts import Facts, Interface, gather_facts

__all__ = ["CHECKS", "CheckResult", "Facts", "Interface", "gather_facts", "run_checks"]
