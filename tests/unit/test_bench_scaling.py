"""bench's strong and weak scaling do what their labels say for a workload whose batch is per rank (train)."""

from __future__ import annotations

import pytest

from multigpu.bench import Launcher, resolve_target
from multigpu.errors import ConfigError
from multigpu.launch.config import LaunchConfig
from multigpu.launch.devices import configs_for


def _global_batches(scaling: str, sizes: tuple[int, ...], *overrides: str) -> dict[int, int]:
    target = resolve_target("train", list(overrides))
    launcher = Launcher(target, configs_for(LaunchConfig(cpu=True), sizes), scaling=scaling)
    return {n: job.config.effective_batch(n) for n, job in launcher.jobs.items()}


@pytest.mark.parametrize("overrides", [(), ("batch_size=6", "grad_accum=2"),
                                       ("grad_accum=4", "grad_accum_scope=global"), ("global_batch_size=32",)])
def test_strong_keeps_the_global_batch_and_weak_keeps_each_ranks(overrides, fake_gpus):
    fake_gpus(0)
    strong = _global_batches("strong", (1, 2), *overrides)
    weak = _global_batches("weak", (1, 2), *overrides)
    assert strong[1] == weak[1]  # the baseline is the plain `multigpu train` run
    assert strong[2] == strong[1]  # the same samples per step in all: each rank does half
    assert weak[2] == 2 * weak[1]  # the same samples per rank: twice the global batch


def test_the_baseline_is_the_smallest_world_size_and_a_batch_that_does_not_split_says_what_would(fake_gpus):
    fake_gpus(0)
    assert _global_batches("strong", (2, 4), "batch_size=4") == {2: 8, 4: 8}
    assert _global_batches("weak", (2, 4), "batch_size=4") == {2: 8, 4: 16}
    with pytest.raises(ConfigError, match=r"strong scaling keeps the global batch at 16 \(the one of 1 rank\(s\)\) "
                                          r"at every world size, but at 3 ranks: global_batch_size=16 is not "
                                          r"divisible by world_size × grad_accum = 3 × 1 = 3"):
        _global_batches("strong", (1, 3))


def test_verify_compares_the_same_global_batch_at_every_world_size(fake_gpus):
    """verify launches through the same Launcher with its default (strong): train at 1 and 2 ranks computes the
    same optimizer steps on the same samples per step, so val_loss differs only by float order."""
    fake_gpus(0)
    launcher = Launcher(resolve_target("train", []), configs_for(LaunchConfig(cpu=True), (1, 2)))
    assert {n: job.config.effective_batch(n) for n, job in launcher.jobs.items()} == {1: 16, 2: 16}
