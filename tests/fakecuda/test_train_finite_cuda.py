"""The non-finite loss guard on fake CUDA: its per-step work stays on the device (no host sync).

Fake CUDA tensors hold no values, so ``.item()``, ``bool(t)`` and copies to the host raise: a
per-step update that ran here synchronised nothing; the check (one all-reduce at a log point) does
need a value, which is where the trainer synchronises anyway.
"""

from __future__ import annotations

import pytest
import torch

from multigpu.testing.fakecuda import fake_cuda
from multigpu.train.finite import FiniteGuard


@pytest.mark.parametrize("scaler_skips", [False, True])
def test_the_per_step_update_needs_no_value_from_the_gpu(scaler_skips):
    with fake_cuda(devices=1):
        guard = FiniteGuard(torch.device("cuda", 0), scaler_skips=scaler_skips)
        for step in range(1, 6):
            loss = torch.full((), float("nan") if step == 3 else 1.0, device="cuda")
            guard.update(step, loss, torch.ones((), device="cuda"))
        assert guard._first.device.type == "cuda" and guard._values.device.type == "cuda"
        with pytest.raises(Exception):  # noqa: B017 - what a host sync does under fake CUDA: the proof above holds
            bool(guard._first == 3)
