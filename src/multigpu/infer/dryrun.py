"""The infer workload as rank r of N: its windows, and one batch of them through the model on fake tensors.

The split is the runner's own (:meth:`multigpu.infer.windows.WindowPlan.rank_bounds`: whole batches,
sharded like ``mg.shard``). The model is built inside torch's ``FakeTensorMode`` and called on one
fake batch of ``batch_size`` windows under ``inference_mode`` with torch's ``MemTracker`` counting the
fake tensors: parameters and the peak of the call (measured). The stitched output lives in rank 0's
host memory and is checked by the workload's own check, not here.
"""

from __future__ import annotations

import contextlib

import torch

from multigpu.jobs.dryrun import Figure, Report

__all__ = ["examine"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def examine(cfg, plan, rank: int, report: Report) -> None:
    from multigpu.errors import ConfigError
    from multigpu.infer import io
    from multigpu.infer.models import DEMO_SIZE
    from multigpu.infer.windows import WindowPlan, as_tuple

    world = plan.world_size
    try:
        infos = [io.probe(p) for p in cfg.inputs] if cfg.inputs else [io.ImageInfo("<demo photo>", 3, DEMO_SIZE)]
        ndim = len(infos[0].size)  # 2 (images) or 3 (volumes); the workload's check refuses a mix
        roi, overlap = as_tuple(cfg.roi, ndim, "roi"), as_tuple(cfg.overlap, ndim, "overlap")
        windows = WindowPlan([tuple(i.size) for i in infos] * plan.run.problem_scale(world), roi, overlap)
    except ConfigError as exc:
        report.errors.append(str(exc))
        return
    start, stop = windows.rank_bounds(cfg.batch_size, world)[rank]
    batches = -(-windows.num_windows // cfg.batch_size)
    report.lines.append(f"{len(infos)} image(s), {windows.num_windows:,} windows of {'x'.join(map(str, roi))} in {batches:,} "
                        f"batches of {cfg.batch_size}; rank {rank} runs windows [{start:,}, {stop:,})")
    if batches < world:
        report.warnings.append(f"{batches:,} batches of windows for {world} ranks: {world - batches} rank(s) get "
                               "no window (they wait for the stitch); fewer ranks or a smaller batch_size do the same "
                               "work")
    batch = min(cfg.batch_size, stop - start)  # the rank's largest batch (0: it only holds the model)
    try:
        params, peak = _one_batch(cfg, batch, infos[0].channels, roi)
    except Exception as exc:  # noqa: BLE001 - a model fake tensors cannot run: said, not measured
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        report.warnings.append(f"one batch on fake tensors failed ({type(exc).__name__}: {first[:200]}); "
                               "memory not measured")
        return
    report.memory += [Figure("parameters", params, "measured"),
                      Figure("activations (peak of one batch)", peak - params, "measured",
                             f"batch {batch}, precision {cfg.precision}")]
    report.peak = Figure("peak of a model call", peak, "measured", "one batch on fake tensors")
    report.memory.append(report.peak)


class _LiveBytes:
    """Bytes of the tensor storages created inside, alive at once: now and at the peak (a dispatch mode;
    torch's MemTracker needs autograd hooks, which inference mode has not)."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        owner = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                owner._count(out)
                return out

        self.mode, self.live, self.peak, self._seen = _Mode(), 0, 0, set()

    def _count(self, out) -> None:
        import weakref

        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._seen:
                continue
            self._seen.add(key)
            size = storage.nbytes()
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size


def _one_batch(cfg, batch: int, channels: int, roi: tuple[int, ...]) -> tuple[int, int]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from multigpu.infer.models import load_model

    precision = _DTYPES[cfg.precision]
    autocast = torch.autocast("cpu", dtype=precision) if precision != torch.float32 else contextlib.nullcontext()
    with FakeTensorMode():
        model = load_model(cfg.model)
        params = sum(p.numel() * p.element_size() for p in getattr(model, "parameters", lambda: [])())
        counter = _LiveBytes()
        with torch.inference_mode(), autocast, counter.mode:
            if batch:
                x = torch.empty((batch, channels, *roi))
                out = model(x, **cfg.call_kwargs)
                del out, x
    return params, params + counter.peak
