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
    from multigpu.train.strategies import wrap_ddp

    model, _ = wrap_ddp(torch.nn.Linear(4, 2), mg.get_env(), "auto")
    model(torch.ones(3, 4)).sum().backward()
    # dropped inside a reference cycle, as a workload's model is (the first DDP of a process leaves its frames in
    # one: an exception torch catches while building it); only the collector frees it
    cycle: list = [model]
    cycle.append(cycle)
    return _gloo_threads()


def _watch_destroy(seen: list) -> contextlib.AbstractContextManager:
    """``destroy_process_group`` noting gloo's threads the moment it returns, before anything else runs."""
    import torch.distributed as dist

    destroy = dist.destroy_process_group

    def watched(*args, **kwargs):
        destroy(*args, **kwargs)
        seen.append(_gloo_threads())

    @contextlib.contextmanager
    def installed():
        dist.destroy_process_group = watched
        try:
            yield
        finally:
            dist.destroy_process_group = destroy

    return installed()


def _ddp_then_shutdown(store: str) -> dict:
    import gc

    from multigpu.launch import _worker

    gc.disable()  # the collector not having run yet, as it may not have in a real rank: DDP's cycles still alive
    during = _train_a_step()  # the model is gone when it returns, as a workload's is before the rank's shutdown
    at_shutdown: list = []
    with _watch_destroy(at_shutdown):
        mg.shutdown()
    after = _gloo_threads()
    # the worker wrapper, after a script that ended well and left its group (and a dropped DDP model) behind
    mg.init(backend="cpu", timeout_s=60, init_method=f"file://{store}")
    _train_a_step()
    at_wrapper: list = []
    with _watch_destroy(at_wrapper):
        _worker._destroy_left_group()
    mg.shutdown()
    return {"during": during, "after": after, "at_shutdown": at_shutdown, "at_wrapper": at_wrapper}


def test_shutdown_after_ddp_ends_every_thread_of_the_process_group(tmp_path):
    """Every thread of the group has ended when ``destroy_process_group`` returns: the group died there, on the
    rank's main thread. Without collecting DDP's cycles first, destroy only dropped the world's reference and the
    group lived on in the garbage until a later collection, which may run on one of gloo's own threads (a comm
    hook's callback allocating): it then freed the group there and joined that very thread ("Resource deadlock
    avoided", a rank aborted once in a full run)."""
    for rank in run_on_ranks(_ddp_then_shutdown, 2, args=(str(tmp_path / "store"),), timeout_s=120):
        assert "gloo_tcp_loop" in rank["during"] and "pt_gloo_runloop" in rank["during"], rank  # the probe sees them
        assert rank["after"] == [], rank
        assert rank["at_shutdown"] == [[]], rank  # mg.shutdown()
        assert rank["at_wrapper"] == [[]], rank  # the worker wrapper's destroy of a group a script left
