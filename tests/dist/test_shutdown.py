"""``mg.shutdown()`` really ends the process group: none of gloo's threads runs on into the interpreter's exit.

A rank that used DDP kept its default process group after ``destroy_process_group()``: DDP imports
``torch.distributed.nn`` (through ``torch._dynamo``), whose functions bind ``group=group.WORLD`` as default
arguments when first imported, i.e. the live group. gloo's three C++ threads (two workers, the TCP loop) then
ran through Python's finalization and exit, and the group was freed, if at all, by the garbage collector while
the interpreter was being torn down (an rl rank once aborted there: "terminate called without an active
exception", after its job had finished).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import multigpu as mg
from multigpu.testing import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]


def _gloo_threads() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            names.append((task / "comm").read_text().strip())
    return sorted(name for name in names if "gloo" in name)


def _train_a_step() -> list[str]:
    """What a workload does: wrap a model in DDP, as rl and train do (gloo: a timed comm hook), and step it."""
    from multigpu.train.sync import wrap_ddp

    model, _ = wrap_ddp(torch.nn.Linear(4, 2), mg.get_env(), "auto")
    model(torch.ones(3, 4)).sum().backward()
    return _gloo_threads()


def _ddp_then_shutdown() -> dict:
    import gc

    gc.disable()  # the collector not having run yet, as it may not have in a real rank: DDP's cycles still alive
    during = _train_a_step()  # the model is gone when it returns, as a workload's is before the rank's shutdown
    mg.shutdown()
    return {"during": during, "after": _gloo_threads()}


def test_shutdown_after_ddp_ends_every_thread_of_the_process_group():
    for rank in run_on_ranks(_ddp_then_shutdown, 2, timeout_s=120):
        assert "gloo_tcp_loop" in rank["during"] and "pt_gloo_runloop" in rank["during"], rank  # the probe sees them
        assert rank["after"] == [], rank
