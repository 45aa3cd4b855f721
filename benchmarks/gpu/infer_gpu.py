"""Sliding-window windows/s on one GPU: multigpu.infer.sliding_window vs MONAI's sliding_window_inference.

    python benchmarks/gpu/infer_gpu.py [--size 4096] [--roi 256] [--batch 16] [--repeats 3]
    python benchmarks/gpu/infer_gpu.py --quick        # a small UNet on a 160x160 image on the CPU: seconds

Same model, same input, same GPU, same arguments (overlap 0.25, Gaussian
blending, bf16 autocast around the model on a GPU, fp32 on a CPU):

* model: MONAI's ``BasicUNet`` (2-D, 1 -> 1 channel, features (32, 32, 64, 128, 256, 32),
  1.9M parameters; seeded), a real-size denoiser; without MONAI a small conv
  stack stands in and the peer is skipped;
* input: one 1 x 1 x S x S float32 image on the host (S = 4096: 441 windows of 256).

Timed host to host, the median of ``--repeats`` after a warm-up pass of each:
``ours`` takes the host tensor (moves it to the GPU once, cuts windows and
stitches there when they fit, else cuts and stitches on the host, a batch
behind the GPU) and returns a host tensor; ``monai`` is what a
MONAI user writes: ``sliding_window_inference(x.cuda(), ...).cpu()``. Also
reported: MONAI with the input already on the GPU and the output left there
(no copies: its best case), and MONAI with ``sw_device=cuda, device=cpu``
(windows on the GPU, stitching on the host, as ours where the GPU is short of memory). The outputs are compared
(largest difference over the output's largest value). Target: ours >= 1.0x monai.

Also the model alone over the same batches (cut on the device beforehand, timed to a sync): with autocast entered
per batch under ``inference_mode`` (ours before), once under ``inference_mode`` (the MONAI user's), and once under
``no_grad`` (ours now: autocast keeps its bf16 copy of each weight across batches only outside inference mode,
so the first two cast every weight for every batch): where our "model" phase's time goes.
"""

from __future__ import annotations

import statistics
import sys

import _common
import torch


def make_model(quick: bool) -> tuple[torch.nn.Module, str]:
    torch.manual_seed(0)
    try:
        from monai.networks.nets import BasicUNet
    except ImportError:
        width = 8 if quick else 64
        net = torch.nn.Sequential(torch.nn.Conv2d(1, width, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.Conv2d(width, width, 3, padding=1), torch.nn.ReLU(),
                                  torch.nn.Conv2d(width, 1, 3, padding=1))
        return net.eval(), f"conv stack 1-{width}-{width}-1 (MONAI not installed)"
    features = (8, 8, 16, 16, 32, 8) if quick else (32, 32, 64, 128, 256, 32)
    return BasicUNet(spatial_dims=2, in_channels=1, out_channels=1, features=features).eval(), f"BasicUNet{features}"


def _without_transformers() -> None:
    """--quick: MONAI's first import imports every subpackage of it, and one of its networks (TransChex, unused here)
    imports transformers, which brings accelerate and torch._dynamo: most of this script's seconds on a CPU. Hidden
    (``None`` in ``sys.modules``), it is an optional dependency MONAI goes without; ``BasicUNet`` and
    ``sliding_window_inference`` never use it. The GPU run imports MONAI as its users do."""
    sys.modules.setdefault("transformers", None)


def _median_seconds(fn, device: torch.device, repeats: int):
    out, times = None, []
    for _ in range(repeats):
        out, seconds = _common.timed(fn, device)
        times.append(seconds)
    return out, statistics.median(times)


def _model_alone(model, x, args, device, precision: str) -> dict[str, float]:
    """The model alone over the same batches, cut on the device beforehand (no stitching), timed to a sync, three
    ways (see the module docstring). Where the time of our "model" phase goes: the GPU's work (these), or the
    host's around it."""
    from multigpu.infer import WindowPlan

    plan = WindowPlan([x.shape[2:]], (args.roi,) * 2, (args.overlap,) * 2)
    image = x[0].to(device)
    crops = [image[:, w.start[0]:w.start[0] + args.roi, w.start[1]:w.start[1] + args.roi]
             for w in plan.windows(0, plan.num_windows)]
    batches = [torch.stack(crops[i:i + args.batch]) for i in range(0, len(crops), args.batch)]
    enabled, dtype = precision != "fp32", torch.bfloat16

    def per_batch():
        with torch.inference_mode():
            for b in batches:
                with torch.autocast(device.type, dtype=dtype, enabled=enabled):
                    model(b)

    def one_context():
        with torch.inference_mode(), torch.autocast(device.type, dtype=dtype, enabled=enabled):
            for b in batches:
                model(b)

    def cached_weights():  # no inference_mode: autocast keeps its bf16 weights from one batch to the next
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=enabled):
            for b in batches:
                model(b)

    out = {}
    for name, fn in (("autocast per batch, inference_mode (ours before)", per_batch),
                     ("one autocast, inference_mode (the MONAI user's)", one_context),
                     ("one autocast, no_grad: weights cast once (ours now)", cached_weights)):
        _, out[name] = _median_seconds(fn, device, args.repeats)
    return out


def main() -> int:
    p = _common.parser(__doc__)
    p.add_argument("--size", type=int, default=4096, help="image side S (the input is 1 x 1 x S x S)")
    p.add_argument("--roi", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="windows per model call")
    p.add_argument("--overlap", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=3)
    _common.add_estimate_flag(p)
    args = p.parse_args()
    if args.quick:
        args.size, args.roi, args.batch, args.repeats = 160, 64, 4, 1
        _without_transformers()
    if args.size < 1 or args.roi < 1 or args.batch < 1 or args.repeats < 1 or not 0 <= args.overlap < 1:
        print("error: --size, --roi, --batch and --repeats must be >= 1 and --overlap in [0, 1)", file=sys.stderr)
        return 2
    from multigpu.infer import WindowPlan, sliding_window

    if args.estimate:  # ours and three MONAI runs, each median of --repeats, a warm-up pass of each, the model alone
        # three times per repeat; 800 windows/s or more on one H100 (the first GPU call, one H200: ours 1,500,
        # MONAI 2,300, MONAI stitching on the host 1,200; the whole step took 22 s)
        windows = WindowPlan([(args.size, args.size)], (args.roi,) * 2, (args.overlap,) * 2).num_windows
        return _common.print_estimate({"start": _common.STARTUP_S, "model and warm-ups": 5.0,
                                       "runs": (7 * args.repeats + 2) * windows / 800.0})

    device = _common.pick_device("cpu" if args.quick and args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    model, model_name = make_model(args.quick)
    model = model.to(device)
    x = torch.rand(1, 1, args.size, args.size, generator=torch.Generator().manual_seed(1))
    windows = WindowPlan([x.shape[2:]], (args.roi,) * 2, (args.overlap,) * 2).num_windows
    blend, precision = "gaussian", ("bf16" if cuda else "fp32")
    print(f"{model_name} on {device}, input 1x1x{args.size}x{args.size}, roi {args.roi}, overlap {args.overlap}, "
          f"batch {args.batch}, {precision}: {windows} windows, median of {args.repeats}", flush=True)

    def run_ours(image):
        return sliding_window(image, model, args.roi, args.overlap, args.batch, blend, precision=precision,
                              progress=False)

    # warm-up: one whole pass, so that the batch's shapes (kernel choice, the allocator's blocks) are warm before
    # ours is timed, as they are for the runs after it (a one-window warm-up left them to ours' first timed pass)
    run_ours(x)
    mine, mine_s = _median_seconds(lambda: run_ours(x), device, args.repeats)
    from multigpu.infer.stats import PHASE_SECONDS  # where the last run's host time went (queueing, on a GPU)

    phases = {k: round(v, 4) for k, v in PHASE_SECONDS.items()}
    record = {"benchmark": "infer_gpu", "machine": _common.machine(),
              "config": {"model": model_name, "size": args.size, "roi": args.roi, "batch": args.batch,
                         "overlap": args.overlap, "blend": blend, "precision": precision, "windows": windows},
              "ours": {"seconds": mine_s, "windows_per_s": windows / mine_s,
                       "peak_memory_gib": _common.peak_memory_gib(device), "phases_s": phases}}
    print(f"  ours                               {mine_s:7.3f} s  {windows / mine_s:9.1f} windows/s  (phases, s: "
          + ", ".join(f"{k} {v:.3f}" for k, v in phases.items()) + ")", flush=True)
    try:
        from monai.inferers import sliding_window_inference
    except ImportError as exc:  # said in the step's row (collect.py), never a silent "—"
        missing = f"MONAI is not installed ({exc}): run bash benchmarks/gpu/fetch_wheels.sh and carry .whl"
        print(f"  PEER MISSING: {missing}", flush=True)
        record |= {"peer": {"skipped": missing}, "peer_missing": missing, "ratio": None,
                   "summary": f"{windows / mine_s:,.0f} windows/s",
                   "targets": {"ratio >= 1.0": None, "outputs agree (< 1e-2 in bf16, 1e-4 in fp32)": None}}
        _common.write_record(args.json, record)
        return 0

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    def run_monai(image, **kw):
        with torch.inference_mode(), autocast:
            return sliding_window_inference(image, args.roi, args.batch, model, args.overlap, blend, **kw)

    run_monai(x.to(device))  # warm-up: one whole pass, as for ours
    peers = {}
    theirs, s = _median_seconds(lambda: run_monai(x.to(device)).float().cpu(), device, args.repeats)
    peers["monai"] = {"seconds": s, "windows_per_s": windows / s, "how": "sliding_window_inference(x.cuda()).cpu()"}
    on_device = x.to(device)
    _, s = _median_seconds(lambda: run_monai(on_device), device, args.repeats)
    peers["monai_device_resident"] = {"seconds": s, "windows_per_s": windows / s, "how": "input and output on the GPU"}
    if cuda:
        _, s = _median_seconds(lambda: run_monai(x, sw_device=device, device="cpu"), device, args.repeats)
        peers["monai_host_stitching"] = {"seconds": s, "windows_per_s": windows / s, "how": "sw_device=cuda, device=cpu"}
    for name, r in peers.items():
        print(f"  {name:<34} {r['seconds']:7.3f} s  {r['windows_per_s']:9.1f} windows/s  (ours {r['seconds'] / mine_s:.2f}x)",
              flush=True)
    record["model_alone_s"] = _model_alone(model, x, args, device, precision)
    print("  the model alone over the same batches, to a sync: " + ", ".join(
        f"{k} {v:.3f} s" for k, v in record["model_alone_s"].items()), flush=True)
    diff = (mine - theirs).abs().max().item() / max(theirs.abs().max().item(), 1e-12)
    ratio = peers["monai"]["seconds"] / mine_s
    print(f"  ours / monai: {ratio:.2f}x; largest output difference {diff:.2e} of the output's largest value")
    record |= {"peer": peers, "ratio": ratio, "output_difference": diff,
               "targets": {"ratio >= 1.0": ratio >= 1.0, "outputs agree (< 1e-2 in bf16, 1e-4 in fp32)":
                           diff < (1e-2 if cuda else 1e-4)}}
    _common.write_record(args.json, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
