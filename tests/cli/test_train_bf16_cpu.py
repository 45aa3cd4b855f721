"""--precision bf16 on a CPU that emulates bf16 ran 4x slower than fp32 with no word: now one line says so."""

from __future__ import annotations

from unittest import mock

import torch

from multigpu.cli import main
from multigpu.train.precision import cpu_bf16_note

NOTE = "no native bf16 (no AVX512-BF16/AMX), so torch emulates it and it runs slower than fp32"


def test_the_note_names_the_flag_only_on_an_emulating_cpu():
    with mock.patch.object(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False):
        assert NOTE in cpu_bf16_note("bf16", "fp32", "cpu") and cpu_bf16_note("bf16", "fp32", "cpu").startswith(
            "--precision bf16 on this CPU")
        assert cpu_bf16_note("fp32", "bf16", "cpu").startswith("--dtype bf16 on this CPU")
        assert cpu_bf16_note("fp32", "fp32", "cpu") is None and cpu_bf16_note("bf16", "fp32", "cuda") is None
    with mock.patch.object(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True):
        assert cpu_bf16_note("bf16", "bf16", "cpu") is None


def test_train_says_it_once_in_the_launcher(tmp_path, capsys):
    with mock.patch.object(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False), \
            mock.patch("multigpu.launch.agent._elastic_launch") as launched:
        assert main(["train", "-f", "nano", "--precision", "bf16", "--nproc-per-node", "2",
                     "--run-dir", str(tmp_path / "run")]) == 0
    assert launched.called and capsys.readouterr().err.count(NOTE) == 1
