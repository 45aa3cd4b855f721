"""The launcher on NCCL: gloo on the same interface as NCCL across nodes, NCCL's flight recorder on and
dumped into the run's log folder, and NCCL's watchdog abort (SIGABRT) named as what it is in the failure summary.
No GPU: host facts are faked through the launcher's seam; the failure summary reads recorded output."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from multigpu.launch import agent
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import HostFacts
from multigpu.launch.rendezvous import gloo_interface
from tests.conftest import SCRIPTS

SCRIPT = str(SCRIPTS / "fail_rank1.py")

# The lines a rank's stderr carries when NCCL's watchdog takes it down: the format of torch's ProcessGroupNCCL.cpp
# messages, as users have posted them (e.g. https://github.com/sgl-project/sglang/issues/1693); the numbers here
# are made up.
WATCHDOG_LOG = """\
[rank1]:[E1124 00:41:12.928019586 ProcessGroupNCCL.cpp:632] [Rank 1] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=30000) ran for 30071 milliseconds before \
timing out.
[rank1]:[E1124 00:41:12.929220797 ProcessGroupNCCL.cpp:1664] [PG ID 0 PG GUID 0(default_pg) Rank 1] Exception \
(either an error or timeout) detected by watchdog at work: 42, last enqueued NCCL work: 42, last completed NCCL work: 41.
[rank1]:[E1124 00:41:12.929246900 ProcessGroupNCCL.cpp:627] [Rank 1] To avoid data inconsistency, we are taking the \
entire process down.
terminate called after throwing an instance of 'c10::DistBackendError'
"""


@pytest.mark.parametrize(("spec", "expected"), [
    ("eth0", "eth0"), ("eth", "eth0"), ("=ib0", "ib0"), ("ib", "ib0"), ("^eth", "ib0"), ("^eth0,ib", "eth1"),
    ("enp", None),
])
def test_gloo_gets_the_interface_nccl_would_use(spec, expected):
    host = [("lo", True), ("docker0", True), ("eth0", True), ("eth1", True), ("ib0", True), ("ib1", False)]
    if spec == "^eth":
        host = [("lo", True), ("eth0", True), ("ib0", True)]
    assert gloo_interface(spec, host) == expected


def _plan(monkeypatch, tmp_path, *, gpus: int, nnodes: int = 1, env: dict | None = None, **cfg):
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(agent, "_host_interfaces", lambda: [("lo", True), ("eth0", True), ("ib0", True)])
    config = LaunchConfig(nnodes=nnodes, rdzv_endpoint="node0:29400" if nnodes > 1 else "localhost:0",
                          log_dir=str(tmp_path / "logs"), **cfg)
    return agent.build_plan(config, SCRIPT, facts=HostFacts(gpu_count=gpus, visible=None, cores=16))


def test_several_nodes_point_gloo_at_nccls_interface(monkeypatch, tmp_path):
    monkeypatch.setenv("MULTIGPU_RDZV_SECRET", "0123456789abcdef")  # several nodes need their shared secret
    plan = _plan(monkeypatch, tmp_path, gpus=2, nnodes=2, env={"NCCL_SOCKET_IFNAME": "ib"})
    assert plan.env["GLOO_SOCKET_IFNAME"] == "ib0"  # before: unset, so gloo took the host name's address
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert "GLOO_SOCKET_IFNAME" not in _plan(monkeypatch, tmp_path, gpus=2, nnodes=2).env  # nothing to follow


def test_an_nccl_job_records_nccls_flight_recorder_into_its_log_folder(monkeypatch, tmp_path):
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                 "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_ENABLE_MONITORING"):
        monkeypatch.delenv(name, raising=False)
    env = _plan(monkeypatch, tmp_path, gpus=2).env
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "1"
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "logs" / "nccl_trace" / "rank_")
    assert agent.nccl_dump_prefix(env) == env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    cpu = _plan(monkeypatch, tmp_path, gpus=0).env  # gloo: no NCCL, nothing to record
    hybrid = _plan(monkeypatch, tmp_path, gpus=1, nproc_per_node=2, allow_cpu_ranks=True).env
    assert not any(k.startswith("TORCH_NCCL") for k in {**cpu, **hybrid})
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "100")  # the user's own setting wins
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in _plan(monkeypatch, tmp_path, gpus=2).env


def _failure(tmp_path: Path, exitcode: int, log: str | None) -> ChildFailedError:
    log_dir = tmp_path / "logs"
    if log is not None:  # torch's layout when output is teed: <log_dir>/<run_id>/attempt_0/<local_rank>/stderr.log
        folder = log_dir / "abc123" / "attempt_0" / "1"
        folder.mkdir(parents=True)
        (folder / "stderr.log").write_text(log)
    failures = {1: ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode, error_file=str(tmp_path / "none.json")),
                0: ProcessFailure(local_rank=0, pid=4241, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "n.json"))}
    failures[1].timestamp, failures[0].timestamp = 1, 2
    return ChildFailedError("train.py", failures)


def test_the_watchdogs_abort_is_named_with_the_collective_and_the_dump(tmp_path):
    dump = tmp_path / "logs" / "nccl_trace"
    dump.mkdir(parents=True)
    (dump / "rank_0").write_bytes(b"x")
    (dump / "rank_1").write_bytes(b"x")
    err = agent.summarize_failure(_failure(tmp_path, -signal.SIGABRT, WATCHDOG_LOG), 2, str(tmp_path / "logs"),
                                  nccl_dump=str(dump / "rank_"))
    first = str(err).splitlines()[0]
    assert first.startswith("rank 1 of 2 failed first") and "NCCL's watchdog aborted it: allreduce (collective #42)" in first
    assert "within 30s (--timeout-s)" in first and "skipped this collective" in first
    assert "NCCL flight recorder: rank_0, rank_1 in " in str(err) and "flight_recorder.fr_trace" in str(err)


def test_sigabrt_on_nccl_without_a_log_is_still_named(tmp_path):
    err = agent.summarize_failure(_failure(tmp_path, -signal.SIGABRT, None), 2, str(tmp_path / "logs"), False,
                                  nccl_dump=str(tmp_path / "logs" / "nccl_trace" / "rank_"))
    assert "on NCCL that is how its watchdog ends a rank" in str(err).splitlines()[0]
    assert "NCCL flight recorder: none written" in str(err)


def test_sigabrt_on_gloo_stays_a_plain_signal(tmp_path):
    err = agent.summarize_failure(_failure(tmp_path, -signal.SIGABRT, None), 2, str(tmp_path / "logs"), False)
    assert str(err).splitlines()[0].endswith("killed by signal SIGABRT") and "NCCL" not in str(err)
