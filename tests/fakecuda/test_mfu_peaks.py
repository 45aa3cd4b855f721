"""MFU's peak by the exact board and the TF32 setting: an H100 PCIe is not an SXM, fp32 is not TF32
when TF32 is off, and a board not in the table has no MFU rather than a guessed one."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch

from multigpu.train.mfu import PEAK_TFLOPS, peak_flops
from tests.conftest import ROOT

CUDA = torch.device("cuda", 0)


def _peak(board: str, precision: str, **kw) -> float | None:
    with mock.patch("torch.cuda.get_device_name", lambda device=None: board):
        return peak_flops(CUDA, precision, **kw)


@pytest.mark.parametrize(("board", "bf16_tflops"), [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.4), ("NVIDIA A100-SXM4-80GB", 312.0),
])
def test_each_h100_board_gets_its_own_bf16_peak(board, bf16_tflops):
    assert _peak(board, "bf16") == pytest.approx(bf16_tflops * 1e12)


def test_fp32_peak_follows_the_tf32_setting():
    board = "NVIDIA H100 80GB HBM3"
    assert _peak(board, "fp32", tf32=True) == pytest.approx(494.7e12)
    assert _peak(board, "fp32", tf32=False) == pytest.approx(66.9e12)  # no tensor cores: not 494
    saved = torch.backends.cuda.matmul.allow_tf32  # a cuBLAS property module: mock cannot patch it
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert _peak(board, "fp32") == pytest.approx(66.9e12)  # default: the setting in force (the trainer's tf32)
        torch.backends.cuda.matmul.allow_tf32 = True
        assert _peak(board, "fp32") == pytest.approx(494.7e12)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("board", ["NVIDIA H100 SuperNew", "NVIDIA GeForce RTX 9090", "H100"])
def test_an_unknown_board_has_no_mfu(board):
    assert _peak(board, "bf16") is None
    assert _peak(board, "bf16", override_tflops=100.0) == 100e12  # the user's figure still counts


def test_a_precision_the_board_lacks_has_no_peak():
    assert _peak("Tesla V100-SXM2-16GB", "bf16") is None and _peak("Tesla V100-SXM2-16GB", "fp32", tf32=True) == 15.7e12


def test_the_gpu_benchmarks_use_the_package_table():
    sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
    try:
        import _common
    finally:
        sys.path.pop(0)
    assert not hasattr(_common, "PEAK_BF16_DENSE")  # one table, in the package
    for board, peaks in PEAK_TFLOPS.items():
        expected = peaks["bf16"] * 1e12 if "bf16" in peaks else None
        assert _common.peak_bf16_flops(board) == expected
    assert _common.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
