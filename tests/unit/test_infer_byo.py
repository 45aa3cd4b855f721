"""Bring your own model to sliding_window: crop tiling, MONAI's names, closures holding modules, call arguments,
tuple and dict outputs."""

from __future__ import annotations

import functools

import pytest
import torch

from multigpu.infer import sliding_window, sliding_window_inference
from multigpu.infer.stitch import crop_bounds
from multigpu.infer.windows import make_grid


class _Ramp(torch.nn.Module):
    """Output = a ramp over the window's own coordinates (the same in every window): the stitched value at a
    pixel tells which window it came from."""

    def forward(self, x):
        h, w = x.shape[-2:]
        ramp = torch.arange(h, dtype=torch.float32)[:, None] * 1000 + torch.arange(w, dtype=torch.float32)[None, :]
        return ramp.expand(x.shape[0], 1, h, w).clone()


def _crop_by_hand(size, roi, overlap):
    """Each pixel from the window whose centre is nearest (what cutting every overlap in its middle means); a pixel
    exactly between two centres goes to the later window."""
    grid = make_grid(size, roi, overlap)
    out = torch.empty(size)
    for y in range(size[0]):
        for x in range(size[1]):
            picks = []
            for d, p in enumerate((y, x)):
                starts = grid.starts[d]
                best = min(range(len(starts)), key=lambda i, p=p, d=d: (abs(p + 0.5 - (starts[i] + roi[d] / 2)), -i))
                picks.append(p - starts[best])
            out[y, x] = picks[0] * 1000 + picks[1]
    return out


@pytest.mark.parametrize("size,roi,overlap", [((45, 61), (16, 24), (0.5, 0.5)), ((40, 40), (16, 16), (0.25, 0.6)),
                                              ((33, 20), (32, 20), (0.3, 0.3))])
def test_crop_tiles_every_pixel_from_one_window_like_a_hand_written_stitcher(size, roi, overlap):
    out = sliding_window(torch.zeros(1, 1, *size), _Ramp(), roi, overlap, batch_size=4, blend="crop", progress=False)
    assert torch.equal(out[0, 0], _crop_by_hand(size, roi, overlap))
    starts = make_grid(size, roi, overlap).starts[0]
    parts = [crop_bounds(starts, roi[0], i) for i in range(len(starts))]
    assert [s + lo for s, (lo, _) in zip(starts, parts, strict=True)][0] == 0
    assert all(starts[i] + parts[i][1] == starts[i + 1] + parts[i + 1][0] for i in range(len(starts) - 1))


def test_monai_names_and_argument_order_give_monais_output():
    monai = pytest.importorskip("monai.inferers", reason="monai is not installed")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Tanh()).eval()
    x = torch.rand(2, 2, 50, 70)
    with torch.no_grad():
        for mode in ("constant", "gaussian"):
            theirs = monai.sliding_window_inference(x, (24, 32), 5, net, 0.25, mode, padding_mode="replicate")
            ours = sliding_window_inference(x, (24, 32), 5, net, 0.25, mode, padding_mode="replicate")
            assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (mode, (ours - theirs).abs().max())


def test_a_closure_or_partial_holding_a_module_and_extra_call_arguments():
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 1, 1)  # pointwise: tiling changes nothing, so the whole-image result is the reference

    def drunet_like(x, sigma):  # DeepInverse's DRUNet takes (x, sigma)
        return conv(x) + sigma

    x = torch.rand(1, 1, 30, 30)
    with torch.no_grad():
        reference = conv(x) + 0.05
    closure = sliding_window(x, drunet_like, 10, 0.0, progress=False, model_kwargs={"sigma": 0.05})
    partial = sliding_window(x, functools.partial(drunet_like, sigma=0.05), 10, 0.0, progress=False)
    assert torch.allclose(closure, reference, atol=1e-6) and torch.equal(closure, partial)
    from multigpu.infer.sliding import _held_modules

    assert _held_modules(drunet_like) == [conv] and _held_modules(functools.partial(drunet_like, sigma=1)) == [conv]


def test_tuple_and_dict_outputs_are_stitched_each():
    torch.manual_seed(1)
    net = torch.nn.Conv2d(2, 2, 3, padding=1).eval()
    x = torch.rand(1, 2, 40, 52)
    kw = dict(roi=16, overlap=0.5, batch_size=3, blend="gaussian", progress=False)
    with torch.no_grad():
        alone = sliding_window(x, net, **kw)
        double = sliding_window(x, lambda t: 2 * net(t), **kw)
        pair = sliding_window(x, lambda t: (net(t), 2 * net(t)), **kw)
        named = sliding_window(x, lambda t: {"mean": net(t), "twice": 2 * net(t)}, **kw)
    assert isinstance(pair, tuple) and torch.equal(pair[0], alone) and torch.equal(pair[1], double)
    assert list(named) == ["mean", "twice"] and torch.equal(named["twice"], double)
