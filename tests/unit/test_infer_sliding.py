"""sliding_window in one process: MONAI's result, output shapes, scale factors, argument errors."""

from __future__ import annotations

import pytest
import torch

from multigpu.errors import ConfigError
from multigpu.infer import sliding_window
from multigpu.infer.models import denoiser, edges, upsample2x


def _net(in_ch=3, out_ch=2, dims=2):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d if dims == 2 else torch.nn.Conv3d
    return torch.nn.Sequential(conv(in_ch, 4, 3, padding=1), torch.nn.Tanh(), conv(4, out_ch, 3, padding=1)).eval()


CASES = [
    # (input shape, roi, overlap, blend, pad_mode, model)
    ((2, 3, 70, 90), 32, 0.25, "constant", "constant", "net"),
    ((1, 3, 20, 90), (32, 40), (0.5, 0.3), "gaussian", "replicate", "net"),  # smaller than the roi in H: padded
    ((1, 3, 64, 64), 64, 0.25, "gaussian", "constant", "net"),  # exactly one window
    ((1, 3, 50, 45), (16, 24), 0.6, "gaussian", "constant", "up"),  # x2 output, 3 -> 3 channels
    ((1, 2, 20, 24, 18), (8, 16, 8), 0.5, "gaussian", "reflect", "net3d"),  # 3-D
]


def _model(name):
    return {"net": lambda: _net(), "up": lambda: upsample2x(), "net3d": lambda: _net(2, 3, dims=3)}[name]()


@pytest.mark.parametrize("shape,roi,overlap,blend,pad_mode,model", CASES)
def test_equals_monai_sliding_window_inference(shape, roi, overlap, blend, pad_mode, model):
    """Same positions, weights and float operations in the same order as MONAI: equal to float tolerance."""
    inferers = pytest.importorskip("monai.inferers")
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    net = _model(model)
    ours = sliding_window(x, net, roi, overlap, 4, blend, pad_mode=pad_mode, progress=False)
    with torch.inference_mode():
        theirs = inferers.sliding_window_inference(x, roi, 4, net, overlap, blend, padding_mode=pad_mode)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.as_tensor() if hasattr(theirs, "as_tensor") else theirs,
                               rtol=1e-5, atol=1e-6)


def test_images_of_different_sizes_come_back_in_order_with_their_sizes():
    g = torch.Generator().manual_seed(2)
    parts = [torch.rand(2, 3, 40, 50, generator=g), torch.rand(1, 3, 10, 12, generator=g)]
    out = sliding_window(parts, edges(), 16, 0.25, 3, "gaussian", progress=False)
    assert [tuple(o.shape) for o in out] == [(2, 1, 40, 50), (1, 1, 10, 12)]
    alone = sliding_window(parts[1], edges(), 16, 0.25, 3, "gaussian", progress=False)
    torch.testing.assert_close(out[1], alone)  # batching across images does not change a result
    assert torch.isfinite(out[0]).all()


def test_constant_image_through_a_denoiser_stays_constant_and_upsampling_doubles_the_size():
    x = torch.full((1, 3, 37, 29), 0.3)
    assert torch.allclose(sliding_window(x, denoiser(), 16, 0.5, 4, "gaussian", progress=False), x, atol=1e-6)
    up = sliding_window(x, upsample2x(), 16, 0.25, 4, "constant", progress=False)
    assert up.shape == (1, 3, 74, 58) and torch.allclose(up, torch.full_like(up, 0.3), atol=1e-5)


def test_uint8_input_and_bf16_autocast():
    x = (torch.rand(1, 3, 40, 40, generator=torch.Generator().manual_seed(3)) * 255).to(torch.uint8)
    fp32 = sliding_window(x, denoiser(), 16, 0.25, 4, progress=False)
    bf16 = sliding_window(x, denoiser(), 16, 0.25, 4, precision="bf16", progress=False)
    assert fp32.dtype == torch.float32 and bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, fp32, rtol=2e-2, atol=2.0)  # bf16 keeps ~3 significant digits of 0..255
    torch.testing.assert_close(fp32, sliding_window(x.float(), denoiser(), 16, 0.25, 4, progress=False))


@pytest.mark.parametrize("kwargs,match", [
    ({"overlap": 1.0}, r"overlap=\[1.0, 1.0\] must be in \[0, 1\)"),
    ({"overlap": -0.1}, "must be in"),
    ({"roi": 0}, "must be >= 1"),
    ({"roi": (8, 8, 8)}, "has 3 entries"),
    ({"batch_size": 0}, "batch_size=0"),
    ({"blend": "mean"}, "blend='mean'"),
    ({"precision": "fp8"}, "precision='fp8'"),
    ({"pad_mode": "wrap"}, "pad_mode='wrap'"),
])
def test_bad_arguments_raise_config_error(kwargs, match):
    args = {"roi": 8, "overlap": 0.25, "batch_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=match):
        sliding_window(torch.zeros(1, 3, 16, 16), denoiser(), progress=False, **args)


def test_bad_models_and_inputs_raise_config_error():
    x = torch.zeros(1, 3, 16, 16)
    with pytest.raises(ConfigError, match="not a whole multiple"):
        sliding_window(x, lambda t: t[:, :, :5, :5], 8, progress=False)
    with pytest.raises(ConfigError, match="returned str"):
        sliding_window(x, lambda t: "not a tensor", 8, progress=False)
    with pytest.raises(ConfigError, match="parts are not all"):
        sliding_window(x, lambda t: (t, 3), 8, progress=False)
    with pytest.raises(ConfigError, match="different spatial sizes"):
        sliding_window(x, lambda t: (t, t[:, :, ::2, ::2]), 8, progress=False)
    with pytest.raises(ConfigError, match=r"\(N, C, H, W\)"):
        sliding_window(torch.zeros(3, 16, 16), denoiser(), 8, progress=False)
    with pytest.raises(ConfigError, match="same number of channels"):
        sliding_window([x, torch.zeros(1, 1, 8, 8)], denoiser(), 8, progress=False)


def test_blended_into_a_view_is_the_quotient_and_phases_are_timed():
    """The output is divided straight into rank 0's tensor (no temporary): the same bits as ``acc / weight``;
    and every call records its seconds per phase for the benchmark's per-rank breakdown."""
    from multigpu.infer.stats import PHASE_SECONDS
    from multigpu.infer.stitch import Canvas

    canvas = Canvas(2, ((3, 13), (0, 8)))
    g = torch.Generator().manual_seed(4)
    canvas.add(torch.rand(2, 6, 8, generator=g), torch.rand(6, 8, generator=g) + 0.1, (3, 0))
    canvas.add(torch.rand(2, 6, 8, generator=g), torch.rand(6, 8, generator=g) + 0.1, (7, 0))
    out = torch.full((2, 20, 8), -1.0)
    box = ((5, 11), (2, 8))
    canvas.blended(box, out=out[:, 5:11, 2:8])
    assert torch.equal(out[:, 5:11, 2:8], canvas.blended(box)) and (out[:, :5] == -1).all()
    sliding_window(torch.rand(1, 3, 40, 40, generator=g), denoiser(), 16, 0.25, 4, progress=False)
    assert {"cut", "model", "blend", "assemble"} <= set(PHASE_SECONDS) and PHASE_SECONDS["model"] > 0


def test_without_a_meter_the_call_is_metered_by_the_run_harness(tmp_path):
    """A call given no meter records through the run harness's meter (``multigpu.run.Run``, as every workload's
    run does), so its run directory has what every run directory has: ``summary.json`` with the call's figures and
    this rank registered with the node's device sampler. Before, the call made a ``StepMeter`` of its own, which
    wrote the summary and nothing else (no ``ranks/`` folder)."""
    import json

    sliding_window(torch.rand(1, 3, 40, 40), denoiser(), 16, 0.25, 4, progress=False, run_dir=tmp_path)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_windows"] == 9 and summary["unit"] == "windows" and summary["steps"] + summary["warmup_steps"] == 3
    assert (tmp_path / "ranks" / "rank0.json").is_file()
    assert not (tmp_path / "checkpoints").exists()  # one pass: no checkpoint
