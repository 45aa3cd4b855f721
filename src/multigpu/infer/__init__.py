"""Distributed sliding-window inference (runs inside each rank).

``sliding_window(inputs, model, roi, overlap, batch_size, blend, precision, pad_mode, progress)``
spreads the windows of any number of 2-D or 3-D images over all ranks, each
window exactly once, blends the overlaps and returns the stitched output on
rank 0, bitwise identical on any number of ranks. From the command line::

    multigpu infer --model multigpu.infer.models:denoiser --input photo.png --output out/ --nproc-per-node 2

Modules: ``windows`` (window grid, pure), ``stitch`` (blending weights and
canvases, pure), ``sliding`` (``sliding_window``: the split over ranks, in three
phases: ``evaluate`` this rank's windows, ``exchange`` what another rank needs,
``assemble`` the output on rank 0, over the ``layout`` of its owned blocks;
``stats`` keeps each phase's seconds for benchmarks),
``config`` (``InferConfig`` for the command), ``models`` (demo models with
fixed filters), ``io`` (PNG/TIFF reading and writing), ``formats`` (``.npy`` arrays
and NIfTI volumes, memory-mapped where the file allows), ``job`` (the
``infer`` workload: its launcher-side check and rank-side main).
"""

from multigpu.infer.sliding import PAD_MODES, PRECISIONS, sliding_window, sliding_window_inference
from multigpu.infer.stitch import BLENDS, Canvas, importance_map
from multigpu.infer.windows import WindowGrid, WindowPlan, make_grid

__all__ = [
    "BLENDS",
    "PAD_MODES",
    "PRECISIONS",
    "Canvas",
    "WindowGrid",
    "WindowPlan",
    "importance_map",
    "make_grid",
    "sliding_window",
    "sliding_window_inference",
]
