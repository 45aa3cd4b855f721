"""The heap policy the launcher gives CPU ranks (multigpu/launch/heap.py): who gets it, what overrides it, and
that a forked worker applies it. That a launched rank reuses its large blocks is checked on real ranks in
tests/cli/test_launch_e2e.py (the fork server's test)."""

import pytest

from multigpu.launch import heap
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import HostFacts, plan_devices

glibc = pytest.mark.skipif(not heap._glibc(), reason="glibc's thresholds (Linux)")


@glibc
def test_cpu_ranks_get_both_thresholds_and_gpu_ranks_neither():
    policy = {"MALLOC_MMAP_THRESHOLD_": str(128 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}
    cpu = plan_devices(LaunchConfig(nproc_per_node=2), HostFacts(gpu_count=0, cores=2), inherited={})
    assert {k: cpu.env[k] for k in policy} == policy
    assert policy.items() <= plan_devices(LaunchConfig(cpu=True), HostFacts(gpu_count=2), inherited={}).env.items()
    gpu = plan_devices(LaunchConfig(), HostFacts(gpu_count=2), inherited={})
    assert not set(policy) & set(gpu.env), gpu.env


@pytest.mark.parametrize("users", [
    {"MALLOC_MMAP_THRESHOLD_": "33554432"},
    {"MALLOC_TRIM_THRESHOLD_": "0"},
    {"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"},
    {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"},
    {"LD_PRELOAD": "/opt/lib/libtcmalloc_minimal.so.4"},
])
def test_a_heap_policy_of_the_users_own_wins(users):
    assert heap.rank_env(users) == {}
    plan = plan_devices(LaunchConfig(nproc_per_node=1), HostFacts(gpu_count=0, cores=2), inherited=users)
    assert not {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(plan.env)


def test_not_glibc_nothing(monkeypatch):
    monkeypatch.setattr(heap, "_glibc", lambda: False)
    assert heap.rank_env({}) == {} and heap.apply({"MALLOC_TRIM_THRESHOLD_": "1"}) == {}
